"""The exceptions soapjax raises for user mistakes, one class per kind of mistake."""

from __future__ import annotations

__all__ = ["ArgumentError", "CostError", "MissingDependencyError", "PlanError", "SettingsError",
           "SoapjaxError", "TopologyError", "TraceError", "UnknownModelError", "WorkloadError"]


class SoapjaxError(Exception):
    """Base class of every error soapjax raises on purpose."""


class TraceError(SoapjaxError, ValueError):
    """The function or its example arguments cannot be traced into an operator graph."""


class UnknownModelError(SoapjaxError, KeyError):
    """A model name that is not in the registry."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class TopologyError(SoapjaxError, ValueError):
    """A topology file is malformed, or the attached devices cannot realise it."""


class PlanError(SoapjaxError, ValueError):
    """A plan does not match the model, the topology or the attached devices."""


class MissingDependencyError(SoapjaxError, ImportError):
    """An optional dependency (matplotlib for pictures) is not installed; the message says how."""


class WorkloadError(SoapjaxError, ValueError):
    """User code given as a model (``--model path/file.py:make_workload``) cannot be loaded, or
    its function returns something else than ``(loss_fn, params or nnx.Module, batch)``."""


class SettingsError(SoapjaxError, ValueError):
    """A setting out of its range: a negative search budget, an unknown simulation mode."""


class ArgumentError(SoapjaxError, TypeError):
    """A public function got an argument of the wrong kind: a topology's name where a
    `Topology` is expected, a dict where `SearchSettings` are, ``"adam"`` where an optax
    optimizer is; the message names the argument and how to make the right one."""


class CostError(SoapjaxError, ValueError):
    """A cost model that cannot be built as asked (e.g. measured mode without the devices)."""
