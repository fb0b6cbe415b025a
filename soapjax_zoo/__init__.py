"""soapjax's model zoo: the FlexFlow paper's benchmarks, plus LeNet, an MLP and GPT-2, and the
large decoders: ``gpt`` (Megatron-LM's shapes, 1.3B to 1T) and ``llama`` (7B, 70B).

Each model is a `Workload` (loss, optimizer, init and synthetic batches) under a registry name,
with a full-size ``default`` config and a ``tiny`` one for tests (the large models name their
sizes too: ``zoo.get("gpt", "175b")``; ``default`` is the smallest)::

  w = zoo.get("gpt2", "tiny")
  step = jax.jit(w.train_step())
  zoo.summarize(zoo.get("gpt2"))  # traced from shapes only: nothing allocated

`load` takes what the command line's ``--model`` takes: a zoo name, or user code
(``path/file.py:make_workload``, see `soapjax_zoo.user`).
"""

from __future__ import annotations

from soapjax_zoo.registry import (
    apis as apis,
    configs as configs,
    for_plan as for_plan,
    get as get,
    load as load,
    names as names,
    names_with as names_with,
)
from soapjax_zoo.workload import (
    ModelConfigError as ModelConfigError,
    ModelSummary as ModelSummary,
    Workload as Workload,
    step_flops as step_flops,
    summarize as summarize,
)

__all__ = [
    "ModelConfigError",
    "ModelSummary",
    "Workload",
    "apis",
    "configs",
    "for_plan",
    "get",
    "load",
    "names",
    "names_with",
    "step_flops",
    "summarize",
]
