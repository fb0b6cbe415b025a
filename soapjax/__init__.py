"""soapjax: find a fast way to shard a JAX/Flax training step over a device mesh, and apply it.

The pipeline, one module per stage (see DESIGN.md): `graph` (jaxpr -> operator graph),
`topology` (cluster files -> mesh axes, links, collective costs), `space` (the SOAP configs of an
operator), `cost` (measured and analytic operator times), `simulate` (task graph, full and delta
simulation), `search` (MCMC), `apply` (shardings and constraints under `jax.jit`). `plot` draws
plans, timelines and comparisons with matplotlib (optional: ``pip install 'soapjax[plot]'``).

`find_plan` is the one way to plan (graph + topology + settings -> `Plan`); the command line,
the training helper and the scripts call it, so its defaults are soapjax's.

The stage modules keep their names (`soapjax.search.search`, `soapjax.simulate.simulate`): a
function re-exported here under its module's name would hide the module.
"""

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

from soapjax.apply import sharded_train_step as sharded_train_step
from soapjax.errors import (
    ArgumentError as ArgumentError,
    MissingDependencyError as MissingDependencyError,
    PlanError as PlanError,
    SoapjaxError as SoapjaxError,
    TopologyError as TopologyError,
    TraceError as TraceError,
    UnknownModelError as UnknownModelError,
    WorkloadError as WorkloadError,
)
from soapjax.graph import Operator as Operator, OpGraph as OpGraph, trace as trace
from soapjax.plan import Plan as Plan
from soapjax.report import register_html_reprs as _register_html_reprs
from soapjax.search import SearchSettings as SearchSettings, find_plan as find_plan
from soapjax.space import (
    Config as Config,
    MeshShape as MeshShape,
    Strategy as Strategy,
    configs as configs,
    data_parallel as data_parallel,
)
from soapjax.topology import (
    Topology as Topology,
    load_topology as load_topology,
    make_mesh as make_mesh,
)

_register_html_reprs()  # Plan, OpGraph and SimResult's notebook HTML

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "Config",
    "MeshShape",
    "MissingDependencyError",
    "OpGraph",
    "Operator",
    "Plan",
    "PlanError",
    "SearchSettings",
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
