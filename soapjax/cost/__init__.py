"""Stage 5, prices: an operator's time (measured, or the GPU kernel model and its roofline), its
FLOPs, the optimizer's update, and what a resharding costs.

- `_reshard_ideal`: The ideal resharding model: which collectives move a tensor between two
  shardings.
- `devicefit`: Kernel efficiency of the attached device, and the ``[device.efficiency]`` table
  fitted from it.
- `flops`: FLOPs one device computes in a training step, counted as XLA counts them.
- `kernels`: The GPU kernel model: one operator's shard as the kernels XLA:GPU runs for it, each
  priced.
- `operators`: Operator times: measured with XLA on the local backend, or a roofline from the
  device specs.
- `reshard`: Which collectives a resharding costs: an ideal model, and what XLA actually inserts.
- `roofline`: The analytic operator time: a roofline from the device's datasheet, for devices not
  attached.
- `updates`: The optimizer's update, read from its jaxpr: the bytes it moves and the scalars it
  reduces.

Its public names are `soapjax.cost.operators`'s, re-exported here.
"""

from soapjax.cost import operators as _operators
from soapjax.cost.operators import (
    ANALYTIC_KERNEL_OVERHEAD_S as ANALYTIC_KERNEL_OVERHEAD_S,
    CACHE_ENV as CACHE_ENV,
    Calibration as Calibration,
    CostError as CostError,
    CostModel as CostModel,
    CostStats as CostStats,
    FlopCounter as FlopCounter,
    OpTime as OpTime,
    ProfileProgress as ProfileProgress,
    ProfileReport as ProfileReport,
    StepFlops as StepFlops,
    Timing as Timing,
    TimingOptions as TimingOptions,
    analytic_op_time as analytic_op_time,
    cache_root as cache_root,
    calibrate as calibrate,
    compute_dtype as compute_dtype,
    cost_model as cost_model,
    default_cache_dir as default_cache_dir,
    local_backend_matches as local_backend_matches,
    local_topology as local_topology,
    roofline_time as roofline_time,
    step_flops as step_flops,
    update_reductions as update_reductions,
)

__all__ = list(_operators.__all__)  # the names of `soapjax.cost.operators`
