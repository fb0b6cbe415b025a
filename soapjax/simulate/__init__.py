"""Stage 6, the execution simulator: a strategy's step as a task graph over devices and links, full
and delta simulation, memory per device.

- `_flatsim`: The flat step's simulator: a training step's task graph, its timeline and its memory.
- `_simresult`: What a simulation returns: the step's timeline, memory and traffic, and its trace
  export.
- `_taskgraph`: The simulator's engine: the task graph, its timing, and the pricing of
  communication tasks.
- `front`: The simulator's entry point: any strategy's step, flat or pipelined, as one result type.
- `pipesim`: Simulating a pipelined strategy: one stage's SPMD step, cut into chunks, timed by a
  schedule.

Its public names are `soapjax.simulate.front`'s, re-exported here.
"""

from soapjax.simulate import front as _front
from soapjax.simulate.front import (
    MemoryBreakdown as MemoryBreakdown,
    OpCosts as OpCosts,
    PipelinedSimulation as PipelinedSimulation,
    PipelineResult as PipelineResult,
    SimResult as SimResult,
    Simulation as Simulation,
    TaskRecord as TaskRecord,
    compare as compare,
    default_pricing as default_pricing,
    folds as folds,
    open_simulation as open_simulation,
    opt_state_factor as opt_state_factor,
    parse_strategy as parse_strategy,
    shard_bytes as shard_bytes,
    simulate as simulate,
)

__all__ = list(_front.__all__)  # the names of `soapjax.simulate.front`
