"""The import paths soapjax's public modules had before they moved into stage folders.

``import soapjax.space`` and ``from soapjax.baselines import megatron`` keep working: each old
path is the new module itself (`MOVED`), so what a user patches or reads there is the real
thing. The folders that took an old module's name (`soapjax.graph`, `soapjax.topology`,
`soapjax.cost`, `soapjax.simulate`, `soapjax.search`, `soapjax.apply`) re-export its public
names instead. New code imports the new paths (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["MOVED", "install"]

# old module under soapjax -> its path now, under soapjax
MOVED: dict[str, str] = {
    "attention": "base.attention",
    "collectives": "base.collectives",
    "errors": "base.errors",
    "space": "strategy.space",
    "memory": "strategy.memory",
    "pipeline": "strategy.pipeline",
    "baselines": "strategy.baselines",
    "plan": "strategy.plan",
    "devices": "measure.devices",
    "links": "measure.links",
    "stepprofile": "measure.stepprofile",
    "hlo": "measure.hlo",
    "roofline": "cost.roofline",
    "kernels": "cost.kernels",
    "devicefit": "cost.devicefit",
    "updates": "cost.updates",
    "flops": "cost.flops",
    "reshard": "cost.reshard",
    "pipesim": "simulate.pipesim",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``soapjax.<old>`` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != "soapjax" or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"soapjax.{MOVED[spec.name.partition('.')[2]]}")
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module ran already, at its new path; the import system just gave it the old
        # path's spec, so it gets its own back (``python -m``, `importlib.reload` read it).
        module.__spec__ = self._specs[module.__name__]


def install() -> None:
    """Puts the old paths' finder on `sys.meta_path` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
