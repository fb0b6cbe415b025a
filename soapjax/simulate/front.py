"""The simulator's entry point: any strategy's step, flat or pipelined, as one result type.

Whether a strategy has pipeline stages is decided here, once: `open_simulation` builds the
stateful simulation the search walks (a `Simulation` of the whole mesh, or a
`soapjax.simulate.pipesim.PipelinedSimulation` over one stage's devices, with its own resharder for
that stage's mesh), and `simulate` returns any strategy's step as a `SimResult` (a pipelined
one's carries its `PipelineResult` in ``SimResult.pipeline``). The default pricing, the cost
model (`soapjax.cost.operators.cost_model`: measured where the topology's devices are attached, else
analytic) and the resharder (`soapjax.cost.reshard.Resharder` in
`soapjax.cost.reshard.DEFAULT_MODE`), is built in one place, `default_pricing`, which the search and
the command line use too.

The engines live beside it: `soapjax.simulate._flatsim` (a step without stages: the task graph, its
timeline and memory, delta and full simulation) and `soapjax.simulate.pipesim` (one stage's step cut
into chunks and timed by a schedule). Hand-written strategies (``--strategy``) are read by
`soapjax.strategy._strategy_file` (`parse_strategy`, re-exported here).

Example::

    result = simulate(graph, topology, strategy)          # flat or pipelined
    result.step_time_s, result.memory, result.pipeline    # pipeline: None without stages
    with open_simulation(graph, topology, strategy) as sim:
        sim.propose(3, config)                            # delta simulation
        sim.reject()
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from soapjax.base._dtypes import itemsize
from soapjax.cost.operators import cost_model as make_cost_model
from soapjax.cost.reshard import DEFAULT_MODE, Resharder, ReshardModel
from soapjax.cost.updates import frozen_leaves
from soapjax.graph.opgraph import OpGraph
from soapjax.simulate._flatsim import OpCosts, Simulation, shard_bytes
from soapjax.simulate._pipe_fold import MIN_LAYERS, layer_fold, tied
from soapjax.simulate._simresult import MemoryBreakdown, SimResult, TaskRecord
from soapjax.simulate.pipesim import (
    PipelinedSimulation,
    PipelineResult,
    as_step_result,
    layer_chunks,
)
from soapjax.strategy._strategy_file import parse_strategy
from soapjax.strategy.space import MeshShape, Strategy, data_parallel
from soapjax.topology.cluster import Topology, stage_topology

__all__ = [
    "MemoryBreakdown", "OpCosts", "PipelineResult", "PipelinedSimulation", "SimResult",
    "Simulation", "TaskRecord", "compare", "default_pricing", "folds", "open_simulation",
    "opt_state_factor", "parse_strategy", "shard_bytes", "simulate",
]


def default_pricing(graph: OpGraph, topology: Topology, *, cost_model: OpCosts | None = None,
                    resharder: ReshardModel | str | None = None
                    ) -> tuple[OpCosts, ReshardModel]:
    """The cost model and resharder a simulation prices with: the ones given, or soapjax's
    defaults (`soapjax.cost.operators.cost_model`; a `Resharder` on the topology's mesh in
    `soapjax.cost.reshard.DEFAULT_MODE`, or in the mode named by a string)."""
    costs = cost_model if cost_model is not None else make_cost_model(graph, topology)
    if resharder is None or isinstance(resharder, str):
        resharder = Resharder(MeshShape.of(topology), mode=resharder or DEFAULT_MODE)
    return costs, resharder


@contextlib.contextmanager
def open_simulation(graph: OpGraph, topology: Topology, strategy: Strategy | None = None, *,
                    cost_model: OpCosts | None = None,
                    resharder: ReshardModel | str | None = None,
                    opt_state_factor: float = 2.0, layer_layout: str = "model",
                    fold: bool = False) -> Iterator[Simulation | PipelinedSimulation]:
    """The stateful simulation of `strategy` (default: data parallelism) that a search walks.

    A strategy without stages gets a `Simulation` on the topology's mesh, priced with
    `resharder` (or the default); a pipelined one a `PipelinedSimulation` whose configs are over
    one stage's devices, with a resharder for that stage's mesh in `resharder`'s mode, made here
    and closed when the block ends (or `resharder` itself where it is on that mesh:
    `soapjax.search.find.check_reshardings` gives one that keeps what it is asked). Both have
    the interface the search uses (`propose`, `propose_many`, `propose_strategy`, `accept`,
    `reject`, `reset`, `step_time`, `fits_in_memory`, `result`). `layer_layout`: where a
    pipelined strategy's stacked layer parameters live between steps
    (`soapjax.simulate.pipesim.LAYER_LAYOUTS`): ``"model"`` as `soapjax.apply.step` stores them,
    ``"chunks"`` as Megatron-LM does. `fold`: a pipelined strategy's stage simulated on a few
    of its layers where they are alike and tied (`soapjax.simulate._pipe_fold`: the same
    prices, no task records; what the search's pipelines use); a proposal that unties them
    is then refused.
    """
    strategy = strategy if strategy is not None else data_parallel(graph, MeshShape.of(topology))
    owned = resharder is None or isinstance(resharder, str)  # made here: closed here
    costs, flat_resharder = default_pricing(graph, topology, cost_model=cost_model,
                                            resharder=resharder)
    try:
        if not strategy.pipelined:
            yield Simulation(graph, topology, costs, flat_resharder, strategy,
                             opt_state_factor=opt_state_factor)
            return
        # the layers first: 4 stages of a 2-layer model is the model's limit, not the mesh's
        layer_chunks(graph, strategy.stages * strategy.virtual_stages, strategy.stage_layers)
        stage_mesh = MeshShape.of(stage_topology(topology, strategy.stages))
        if getattr(flat_resharder, "mesh", None) == stage_mesh:  # given for one stage
            yield PipelinedSimulation(graph, topology, costs, flat_resharder, strategy,
                                      opt_state_factor=opt_state_factor,
                                      layer_layout=layer_layout, fold=fold)
            return
        mode = getattr(flat_resharder, "mode", DEFAULT_MODE)
        with Resharder(stage_mesh, mode=mode) as stage_resharder:
            yield PipelinedSimulation(graph, topology, costs, stage_resharder, strategy,
                                      opt_state_factor=opt_state_factor,
                                      layer_layout=layer_layout, fold=fold)
    finally:
        if owned:
            flat_resharder.close()


def folds(graph: OpGraph, strategy: Strategy) -> bool:
    """Whether ``open_simulation(..., fold=True)`` prices `strategy` on a folded stage (a
    pipelined strategy whose layers are alike, tied and many enough:
    `soapjax.simulate._pipe_fold`): prices extrapolated from a few layers, which the search
    checks on the whole stage for the plans it ends on."""
    if not strategy.pipelined:
        return False
    fold = graph.memo("layer_fold", lambda: layer_fold(graph))
    return fold is not None and fold.layers >= MIN_LAYERS and tied(graph, fold, strategy)


def simulate(graph: OpGraph, topology: Topology, strategy: Strategy, *,
             cost_model: OpCosts | None = None, resharder: ReshardModel | str | None = None,
             opt_state_factor: float = 2.0, layer_layout: str = "model") -> SimResult:
    """Full simulation of one training step of any strategy (Algorithm 1).

    Args:
      graph: the operator graph (`soapjax.graph.opgraph.trace`).
      topology: the cluster (`soapjax.topology.cluster.load_topology`).
      strategy: a config per operator, with or without pipeline stages.
      cost_model: defaults to ``soapjax.cost.operators.cost_model(graph, topology)``.
      resharder: a resharder on the topology's mesh, or a mode (default
        `soapjax.cost.reshard.DEFAULT_MODE`, as `soapjax.search.find.find_plan`); a pipelined
        strategy is priced by one of the same mode on one stage's mesh.
      opt_state_factor: optimizer state bytes per parameter byte (2 for Adam; `opt_state_factor`).
      layer_layout: a pipelined strategy's stacked layer parameters between steps
        (`soapjax.simulate.pipesim.LAYER_LAYOUTS`): ``"model"``, as `soapjax.apply.step` runs
        them (uneven stages' layers moved every step; an interleaved pipeline's kept in chunk
        order); ``"chunks"``, as Megatron-LM does (nothing moved, nor summed over the stages).

    Returns:
      The step time, its breakdown, memory per device and the timeline; for a pipelined
      strategy, one stage's work with the pipeline's step time and its fullest stage's memory,
      and the pipeline itself in ``SimResult.pipeline`` (bubble, stage memory, chunk times).
    """
    with open_simulation(graph, topology, strategy, cost_model=cost_model, resharder=resharder,
                         opt_state_factor=opt_state_factor, layer_layout=layer_layout) as sim:
        if isinstance(sim, PipelinedSimulation):
            collectives, sent = sim.step_collectives()
            pipelined = dataclasses.replace(sim.result(), collectives=collectives,
                                            sent_bytes=sent,
                                            stage_permutes=sim.stage_permutes())
            return as_step_result(pipelined, sim.stage_result(), topology.num_devices)
        return sim.result()


def compare(graph: OpGraph, topology: Topology, strategies: Mapping[str, Strategy], *,
            cost_model: OpCosts | None = None, resharder: ReshardModel | str | None = None,
            opt_state_factor: float = 2.0) -> dict[str, SimResult]:
    """Simulates several strategies with the same costs, like for like (`simulate` each).

    Example::

        results = compare(graph, topology, {"plan": plan.strategy(graph),
                                            **baselines.baselines(graph, topology)})
        soapjax.plot.comparison_figure(results)

    Returns:
      Strategy name -> its `SimResult`, in the order given.
    """
    owned = resharder is None or isinstance(resharder, str)
    cost_model, resharder = default_pricing(graph, topology, cost_model=cost_model,
                                            resharder=resharder)
    try:
        return {name: simulate(graph, topology, s, cost_model=cost_model, resharder=resharder,
                               opt_state_factor=opt_state_factor)
                for name, s in strategies.items()}
    finally:
        if owned:
            resharder.close()


def opt_state_factor(optimizer: Any, params: Any) -> float:
    """Optimizer state bytes per parameter byte, from `jax.eval_shape` (nothing allocated).

    Example: ``opt_state_factor(optax.adam(1e-3), params)`` is 2.0 (plus a step counter).
    Per byte of the trained parameters: those the optimizer freezes
    (`soapjax.cost.updates.frozen_leaves`, a LoRA's base weights) hold no state, and the
    simulator counts the state on the others' shards.
    """
    def nbytes(leaves: Any) -> int:
        return sum(math.prod(x.shape) * itemsize(x.dtype) for x in leaves if hasattr(x, "shape"))

    state = jax.eval_shape(optimizer.init, params)
    leaves = jax.tree.leaves(params)
    trained = [x for x, f in zip(leaves, frozen_leaves(optimizer, params)) if not f]
    return nbytes(jax.tree.leaves(state)) / max(nbytes(trained), 1)
