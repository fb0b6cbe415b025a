"""Checks of the arguments of the public functions that plan, before any work.

Python's own error for a topology name passed where a `Topology` belongs is an
``AttributeError: 'str' object has no attribute 'axis_names'`` raised deep inside planning; these
checks raise `ArgumentError` naming the argument, what it should be and how to make it, so
``find_plan(graph, "cpu8")``, ``find_plan(..., settings={"budget_s": 1})`` and
``shard_training(..., "adam")`` fail in one line that says what to pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from soapjax.base.errors import ArgumentError
from soapjax.graph.opgraph import OpGraph
from soapjax.topology.cluster import Topology


def _found(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_graph(graph: Any, where: str) -> None:
    if not isinstance(graph, OpGraph):
        raise ArgumentError(f"{where}: expected graph to be an OpGraph, found {_found(graph)}; "
                            "make one with soapjax.trace(loss_fn, params, batch)")


def check_topology(topology: Any, where: str) -> None:
    """ArgumentError unless `topology` is a `Topology` (a name or path says how to load it)."""
    if isinstance(topology, Topology):
        return
    hint = (f"soapjax.load_topology({str(topology)!r})" if isinstance(topology, str)
            else "soapjax.load_topology(name or .toml path)")
    raise ArgumentError(f"{where}: expected topology to be a soapjax Topology, found "
                        f"{_found(topology)}; pass {hint} (see `soapjax meshes`)")


def check_settings(settings: Any, cls: type, where: str, name: str = "settings") -> None:
    """ArgumentError unless `settings` is None or a `cls` (a dict says how to make one)."""
    if settings is None or isinstance(settings, cls):
        return
    if isinstance(settings, Mapping):
        args = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        hint = f"{cls.__name__}({args})"
    else:
        hint = f"{cls.__name__}(...)"
    raise ArgumentError(f"{where}: expected {name} to be a {cls.__name__} or None, found "
                        f"{_found(settings)}; pass {name}={hint}")


def check_optimizer(optimizer: Any, where: str) -> None:
    """ArgumentError unless `optimizer` looks like an optax transformation (init, update)."""
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return
    hint = f"optax.{optimizer}(learning_rate)" if isinstance(optimizer, str) and \
        optimizer.isidentifier() else "optax.adam(learning_rate)"
    raise ArgumentError(f"{where}: expected optimizer to be an optax GradientTransformation "
                        f"(with init and update), found {_found(optimizer)}; pass e.g. {hint}")


def check_costs(costs: Any, where: str) -> None:
    """ArgumentError unless `costs` is one of the cost sources' names or a cost model."""
    if not isinstance(costs, str) or costs in COST_SOURCES:
        return
    raise ArgumentError(f"{where}: expected costs to be one of {', '.join(map(repr, COST_SOURCES))}"
                        f" or a soapjax.cost.operators.CostModel, found {_found(costs)}")


# The names `costs=` takes: measured where the topology's devices are attached, else analytic;
# measured; analytic (the roofline of the topology's device).
COST_SOURCES = ("auto", "measured", "analytic")
