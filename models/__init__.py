"""soapjax's model zoo: the FlexFlow paper's benchmarks, plus LeNet, an MLP and GPT-2.

Each model is a `Workload` (loss, optimizer, init and synthetic batches) under a registry name,
with a full-size ``default`` config and a ``tiny`` one for tests::

  w = models.get("gpt2", "tiny")
  step = jax.jit(w.train_step())
  models.summarize(models.get("gpt2"))  # traced from shapes only: nothing allocated

`load` takes what the command line's ``--model`` takes: a zoo name, or user code
(``path/file.py:make_workload``, see `models.user`).
"""

from __future__ import annotations

from models.registry import apis as apis
from models.registry import configs as configs
from models.registry import get as get
from models.registry import load as load
from models.registry import names as names
from models.workload import ModelConfigError as ModelConfigError
from models.workload import ModelSummary as ModelSummary
from models.workload import Workload as Workload
from models.workload import step_flops as step_flops
from models.workload import summarize as summarize

__all__ = [
    "ModelConfigError",
    "ModelSummary",
    "Workload",
    "apis",
    "configs",
    "get",
    "load",
    "names",
    "step_flops",
    "summarize",
]
