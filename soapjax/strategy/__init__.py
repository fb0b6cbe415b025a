"""Stage 3, the SOAP space: an operator's configs on named mesh axes, strategies, recomputation and
microbatches, pipeline stages and schedules, the baselines, and plan files.

- `_arguments`: Checks of the arguments of the public functions that plan, before any work.
- `_strategy_file`: Strategies written by hand: what ``soapjax simulate --strategy`` takes.
- `baselines`: Hand-made strategies: the baselines every searched plan is compared with (and starts
  from).
- `memory`: The memory dimensions of a strategy: activation recomputation and microbatches.
- `pipeline`: The pipeline dimension (the O of SOAP): stages, virtual stages and their schedules.
- `_schedule_time`: Timing a pipeline schedule (`pipeline.time_schedule`'s engine).
- `plan`: Plans: a strategy with its provenance, saved as versioned JSON.
- `space`: The SOAP search space on named mesh axes: the configs of an operator, and strategies.
"""

__all__: list[str] = []
