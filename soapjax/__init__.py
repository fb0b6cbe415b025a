"""soapjax: find a fast way to shard a JAX/Flax training step over a device mesh, and apply it.

The pipeline, one folder per stage, in the order data flows (docs/architecture.md): `base`
(errors, caches, attention as models call it), `graph` (jaxpr -> operator graph), `topology`
(cluster files -> devices, links, named mesh axes), `strategy` (the SOAP space, pipeline stages,
baselines, plan files), `measure` (timing and HLO on the attached devices), `cost` (operator
and resharding prices), `simulate` (task graph, full and delta simulation), `search` (MCMC),
`apply` (shardings, constraints and pipelines under `jax.jit`). On top: `training` (the Flax
loop helper), `check` and `exactness` (a plan against the devices and against `jax.grad`),
`report` and `plot` (matplotlib, optional: ``pip install 'soapjax[plot]'``), `cli`.

`find_plan` is the one way to plan (graph + topology + settings -> `Plan`); the command line,
the training helper and the scripts call it, so its defaults are soapjax's.

The stage folders keep their names (`soapjax.search.search`, `soapjax.simulate.simulate`): a
function re-exported here under its folder's name would hide the folder. The modules' paths
before the folders (``soapjax.space``, ``soapjax.baselines``) still import (`soapjax._moved`).
"""

import importlib
import os as _os
import signal as _signal
import sys as _sys

if _os.path.basename(_sys.argv[0] if _sys.argv else "") == "soapjax" \
        and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    # The command line, starting: Ctrl-C while jax and the stages import ends it in one line
    # (`soapjax.cli.main` takes Ctrl-C over once it runs).
    def _interrupted_while_starting(signum, frame):
        _os.write(2, b"\nsoapjax: interrupted while starting\n")
        _os._exit(130)

    _signal.signal(_signal.SIGINT, _interrupted_while_starting)

from soapjax import _moved
from soapjax.apply.step import sharded_train_step as sharded_train_step
from soapjax.base.errors import (
    ArgumentError as ArgumentError,
    CostError as CostError,
    MissingDependencyError as MissingDependencyError,
    PlanError as PlanError,
    SettingsError as SettingsError,
    SoapjaxError as SoapjaxError,
    TopologyError as TopologyError,
    TraceError as TraceError,
    UnknownModelError as UnknownModelError,
    WorkloadError as WorkloadError,
)
from soapjax.graph.opgraph import Operator as Operator, OpGraph as OpGraph, trace as trace
from soapjax.report import register_html_reprs as _register_html_reprs
from soapjax.search import SearchSettings as SearchSettings, find_plan as find_plan
from soapjax.strategy.plan import Plan as Plan
from soapjax.strategy.space import (
    Config as Config,
    MeshShape as MeshShape,
    Strategy as Strategy,
    configs as configs,
    data_parallel as data_parallel,
)
from soapjax.topology.cluster import (
    Topology as Topology,
    load_topology as load_topology,
    make_mesh as make_mesh,
)

_register_html_reprs()  # Plan, OpGraph and SimResult's notebook HTML
_moved.install()  # the modules' paths before the stage folders (``soapjax.space``)


def __getattr__(name: str):
    """``soapjax.space`` and the other old module paths as attributes (`soapjax._moved`)."""
    if name in _moved.MOVED:
        return importlib.import_module(f"soapjax.{name}")
    raise AttributeError(f"module 'soapjax' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "CostError",
    "Config",
    "MeshShape",
    "MissingDependencyError",
    "OpGraph",
    "Operator",
    "Plan",
    "PlanError",
    "SearchSettings",
    "SettingsError",
    "SoapjaxError",
    "Strategy",
    "Topology",
    "TopologyError",
    "TraceError",
    "UnknownModelError",
    "WorkloadError",
    "configs",
    "data_parallel",
    "find_plan",
    "load_topology",
    "make_mesh",
    "sharded_train_step",
    "trace",
]
