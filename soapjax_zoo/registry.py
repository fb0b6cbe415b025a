"""The model registry: names, their configs, and `get`, which builds a `Workload`.

Example::

  >>> import soapjax_zoo as zoo
  >>> zoo.names()  # doctest: +NORMALIZE_WHITESPACE
  ('alexnet', 'inception_v3', 'resnet101', 'rnntc', 'rnnlm', 'nmt', 'lenet', 'mlp', 'gpt2',
   'gpt', 'llama', 'moe')
  >>> zoo.names(large=False)  # doctest: +NORMALIZE_WHITESPACE
  ('alexnet', 'inception_v3', 'resnet101', 'rnntc', 'rnnlm', 'nmt', 'lenet', 'mlp', 'gpt2')
  >>> zoo.configs("gpt2")
  ('default', 'tiny')
  >>> zoo.configs("llama")[:5]
  ('default', 'tiny', 'tiny-flash', '7b', '70b')
  >>> zoo.get("mlp", "tiny", api="nnx").api
  'nnx'
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from soapjax.base.errors import PlanError, UnknownModelError, WorkloadError
from soapjax.strategy.plan import Plan
from soapjax_zoo import cnn, gpt, gpt2, llama, mlp, moe, rnn, user
from soapjax_zoo.workload import ModelConfigError, Workload


class _Entry(NamedTuple):
    configs: Mapping[str, Any]
    build: Callable[[str, str, Any, str], Workload]
    apis: tuple[str, ...] = ("linen",)
    large: bool = False  # billions of parameters: plan from shapes, never run on this host


_REGISTRY: Mapping[str, _Entry] = types.MappingProxyType(
    {
        "alexnet": _Entry(cnn.ALEXNET_CONFIGS, cnn.build_alexnet),
        "inception_v3": _Entry(cnn.INCEPTION_V3_CONFIGS, cnn.build_inception_v3),
        "resnet101": _Entry(cnn.RESNET101_CONFIGS, cnn.build_resnet101),
        "rnntc": _Entry(rnn.RNNTC_CONFIGS, rnn.build_rnntc),
        "rnnlm": _Entry(rnn.RNNLM_CONFIGS, rnn.build_rnnlm),
        "nmt": _Entry(rnn.NMT_CONFIGS, rnn.build_nmt),
        "lenet": _Entry(cnn.LENET_CONFIGS, cnn.build_lenet, ("linen", "nnx")),
        "mlp": _Entry(mlp.MLP_CONFIGS, mlp.build_mlp, ("linen", "nnx")),
        "gpt2": _Entry(gpt2.GPT2_CONFIGS, gpt2.build_gpt2),
        "gpt": _Entry(gpt.GPT_CONFIGS, gpt.build_gpt, large=True),
        "llama": _Entry(llama.LLAMA_CONFIGS, llama.build_llama, large=True),
        "moe": _Entry(moe.MOE_CONFIGS, moe.build_moe, large=True),
    }
)


def names(*, large: bool = True) -> tuple[str, ...]:
    """The registered model names, in registry order.

    Args:
      large: include the large models (``gpt``, ``llama``, ``moe``: billions of parameters at
        every size but ``tiny``, for planning from shapes; too big to measure or run on one host).
    """
    return tuple(n for n, e in _REGISTRY.items() if large or not e.large)


def configs(name: str) -> tuple[str, ...]:
    """The config names of model `name`, e.g. ``("default", "tiny")``.

    Raises:
      UnknownModelError: `name` is not registered.
    """
    return tuple(_entry(name).configs)


def names_with(config: str) -> tuple[str, ...]:
    """The models that have a config (size) named `config`, in registry order:
    ``names_with("13b") == ("gpt",)``.

    Raises:
      UnknownModelError: no model has it; the message lists every size, with the nearest.
    """
    found = tuple(n for n, e in _REGISTRY.items() if config in e.configs)
    if found:
        return found
    sizes = list(dict.fromkeys(c for e in _REGISTRY.values() for c in e.configs))
    close = difflib.get_close_matches(str(config), sizes, n=1)
    raise UnknownModelError(f"no model of the zoo has size {config!r}; expected one of: "
                            f"{', '.join(sizes)} (`soapjax models` lists each model's)"
                            + (f"; did you mean {close[0]!r}?" if close else ""))


def apis(name: str) -> tuple[str, ...]:
    """The Flax APIs model `name` is written in: ``("linen",)`` or ``("linen", "nnx")``.

    Raises:
      UnknownModelError: `name` is not registered.
    """
    return _entry(name).apis


def get(name: str, config: str = "default", *, api: str = "linen",
        batch_size: int | None = None) -> Workload:
    """Builds the workload of model `name` in config `config`.

    Building allocates nothing: parameters and batches exist only once `init_params` and
    `make_batch` are called. The same arguments return the same `Workload` object, so jitted
    functions of it are cached across calls.

    Args:
      name: a registered name, see `names()`.
      config: one of `configs(name)`.
      api: ``"linen"``, or ``"nnx"`` where `apis(name)` has it.
      batch_size: samples per step instead of the config's (e.g. the config's batch per
        device times the device count, to scale the workload with the cluster as the FlexFlow
        paper's throughput figures do).

    Returns:
      The workload.

    Raises:
      UnknownModelError: unknown name, config or api; the message lists the valid choices.
      ModelConfigError: `batch_size` is not a positive integer.
    """
    entry = _entry(name)
    if config not in entry.configs:
        raise UnknownModelError(
            f"model {name!r} has no config {config!r}; expected one of: {', '.join(entry.configs)}"
        )
    if api not in entry.apis:
        raise UnknownModelError(
            f"model {name!r} is not available in api {api!r}; expected one of: "
            f"{', '.join(entry.apis)}"
        )
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ModelConfigError(f"model {name!r}: batch_size must be a positive integer, got "
                               f"{batch_size!r}")
    return _build(name, config, api, batch_size)


def load(model: str, config: str = "default", *, api: str | None = None,
         batch_size: int | None = None) -> Workload:
    """What the command line's ``--model`` names: a zoo model, or user code (`soapjax_zoo.user`).

    Example: ``load("gpt2", "tiny")`` is ``get("gpt2", "tiny")``; ``load("my_model.py:make")``
    runs ``make()`` from ``my_model.py``.

    Args:
      model: a registered name, ``path/file.py:FUNCTION`` or ``package.module:FUNCTION``.
      config: the zoo config; user code has none (leave it ``"default"``).
      api: the zoo model's Flax API (default linen); user code says its own.
      batch_size: samples per step instead of the config's (`get`); not for user code.

    Raises:
      UnknownModelError: an unknown zoo name, config or api.
      WorkloadError: user code that cannot be loaded, or a config or api given for it.
    """
    if user.is_user_code(model):
        if batch_size is not None:
            raise WorkloadError(f"--model {model!r} is user code: --batch-size is for zoo "
                                "models; its function builds the batch it wants")
        given = ([f"--size {config}"] if config not in ("default", "") else []) \
            + ([f"--api {api}"] if api is not None else [])
        if given:
            raise WorkloadError(f"--model {model!r} is user code: {' and '.join(given)} "
                                f"{'is' if len(given) == 1 else 'are'} for zoo models; its "
                                "function builds the model it wants (drop the flag)")
        return user.load(model)
    if model not in _REGISTRY:
        try:
            _entry(model)
        except UnknownModelError as e:
            raise UnknownModelError(f"{e}; or user code: {user.FORM}") from None
    return get(model, config, api=api or "linen", batch_size=batch_size)


def for_plan(plan: Plan) -> Workload:
    """The workload a plan was made for, as `soapjax check` rebuilds it.

    The user code the plan records (`Plan.workload`, the ``--model`` text; relative paths from
    the current directory), else the zoo model by the plan's model name and config.

    Raises:
      PlanError: the plan is for a model that is not in the zoo and records no user code.
      WorkloadError: the user code the plan records cannot be loaded.
    """
    if not plan.workload and plan.model not in names():
        raise PlanError(f"plan is for model {plan.model!r}, which is not in the zoo; `soapjax "
                        f"check` rebuilds the model by name (zoo models: {', '.join(names())}) "
                        "or from the --model text a plan of user code records (`soapjax plan "
                        "--model path/file.py:FUNCTION`)")
    if plan.workload:
        return load(plan.workload, "default")
    config = plan.model_config or "default"
    default = get(plan.model, config).batch_size
    batch = plan.batch_size if plan.batch_size and plan.batch_size != default else None
    return load(plan.model, config, batch_size=batch)


@functools.cache
def _build(name: str, config: str, api: str, batch_size: int | None) -> Workload:
    entry = _REGISTRY[name]
    cfg = entry.configs[config]
    if batch_size is not None:
        cfg = dataclasses.replace(cfg, batch_size=batch_size)
    return entry.build(name, config, cfg, api)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        message = f"unknown model {name!r}; expected one of: {', '.join(_REGISTRY)}"
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
        raise UnknownModelError(message) from None
