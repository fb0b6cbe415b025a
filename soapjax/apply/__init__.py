"""Stage 8, apply: a plan becomes shardings, sharding constraints and pipelined shard_map programs
under jax.jit.

- `_context_parallel`: Apply for an attention operator whose query sequence is split: context
  parallelism, as
- `_flatstep`: The step without pipeline stages: the traced loss with a sharding constraint on
  every operator.
- `_layer_order`: An interleaved pipeline's stacked layer parameters kept in the order its chunks
  run them.
- `_manual`: Apply for equations XLA's partitioner gets wrong or runs whole: apply runs them in
- `_pipeline_layout`: A pipelined strategy's layout: the layer scan its stages cut, the mesh it
  runs on, and where
- `_pipelined`: Pipeline parallelism as one SPMD program: the traced step cut at its layer scan,
  its chunks
- `_shardings`: The shardings of a sharded train step's inputs and outputs: parameters, optimizer
  state, batch.
- `_validation`: Validation before apply: a strategy or plan against a traced graph and a
  `jax.sharding.Mesh`.
- `step`: Apply: a strategy becomes `NamedSharding`s and sharding constraints under `jax.jit`.

Its public names are `soapjax.apply.step`'s, re-exported here.
"""

from soapjax.apply import step as _step
from soapjax.apply.step import (
    Checked as Checked,
    ChunkOrdered as ChunkOrdered,
    PartitionedStep as PartitionedStep,
    Partitioner as Partitioner,
    TrainShardings as TrainShardings,
    batch_shardings as batch_shardings,
    collectives_as_run as collectives_as_run,
    constrained_loss as constrained_loss,
    device_put_global as device_put_global,
    model_layout as model_layout,
    opt_state_shardings as opt_state_shardings,
    param_shardings as param_shardings,
    recompute_segments as recompute_segments,
    sharded_train_step as sharded_train_step,
    sharded_value_and_grad as sharded_value_and_grad,
    step_layout as step_layout,
    strategy_from_names as strategy_from_names,
    train_shardings as train_shardings,
    validate_strategy as validate_strategy,
)

__all__ = list(_step.__all__)  # the names of `soapjax.apply.step`
