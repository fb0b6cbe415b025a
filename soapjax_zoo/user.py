"""Workloads from user code: ``--model path/file.py:make_workload`` or ``package.module:fn``.

The function takes no arguments and returns ``(loss_fn, params, batch)`` or ``(loss_fn, params,
batch, optimizer)``:

* ``loss_fn(params, batch) -> scalar``, or for an nnx model ``loss_fn(model, batch)``;
* ``params``: the parameters (arrays or `jax.ShapeDtypeStruct`s), or an `nnx.Module`, whose
  `nnx.Param` state is trained (as `soapjax.training.shard_training` does);
* ``batch``: one example batch (arrays or `jax.ShapeDtypeStruct`s; dim 0 is the batch);
* ``optimizer``: an optax transformation (default ``optax.adam(1e-3)``), or for an nnx model
  an `nnx.Optimizer` (its ``tx``, and its ``wrt``: the parameters it trains, the others
  frozen).

A ten-line example, ``my_model.py``::

    import flax.linen as nn, jax, jax.numpy as jnp, optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(256)(x)))

    def make_workload():
        model, x = MLP(), jax.ShapeDtypeStruct((64, 784), jnp.float32)
        batch = {"x": x, "y": jax.ShapeDtypeStruct((64,), jnp.int32)}
        params = jax.eval_shape(model.init, jax.random.key(0), x)
        def loss_fn(params, batch):
            logits = model.apply(params, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss_fn, params, batch

The workload is named after the file or module (``my_model``), which is the traced graph's
name and so part of its fingerprint. Where ``params`` or ``batch`` are `ShapeDtypeStruct`s,
`Workload.init_params` and `Workload.make_batch` draw them for `soapjax check`: normal floats
(parameters at 0.02), and integers uniform below what they index where the loss reads them
only as indices (tokens, labels: `index_bounds`), else zeros. Pass the parameters themselves
where their initialisation matters to the check (at 0.02 an attention is nearly uniform, and
its queries' gradients under float32's resolution of the largest). Like uvicorn, the current
directory is searched for ``package.module``; a file is run with its own folder on
``sys.path`` while it is imported.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.extend  # noqa: F401  (jax.extend must be imported explicitly)
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend import core as jcore

from soapjax._nnx import optax_of, pure_loss
from soapjax.base.errors import WorkloadError
from soapjax.cost.updates import optimizer_problem
from soapjax_zoo.workload import Workload

FORM = ("FILE.py:FUNCTION or package.module:FUNCTION, a function returning "
         "(loss_fn, params or nnx.Module, batch[, optimizer])")


def is_user_code(model: str) -> bool:
    """Whether a ``--model`` value names user code rather than a zoo model."""
    return ":" in model or model.endswith(".py") or "/" in model or os.sep in model


def load(spec: str) -> Workload:
    """The workload returned by the function `spec` names (see the module doc).

    Raises:
      WorkloadError: no ``:FUNCTION``; a missing file; a module that cannot be imported; no
        such function; a function that raises or returns something else than the module doc
        says. The message names the `spec` and what was found.
    """
    where, sep, fn_name = spec.rpartition(":")
    if not sep or not where or not fn_name:
        raise WorkloadError(f"--model {spec!r}: expected {FORM}")
    if ":" in where and not os.path.exists(where):
        raise WorkloadError(f"--model {spec!r}: expected one ':' between the file or module and "
                            f"the function ({FORM}), found {spec.count(':')}")
    if not fn_name.isidentifier():
        raise WorkloadError(f"--model {spec!r}: {fn_name!r} is not a function name; expected "
                            f"{FORM}")
    module = _import_file(spec, where) if where.endswith(".py") or "/" in where \
        else _import_module(spec, where)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        near = difflib.get_close_matches(fn_name, names, n=3)
        hint = (f"; did you mean {', '.join(map(repr, near))}?" if near
                else f"; its functions: {', '.join(names[:8])}" if names else "")
        what = "no function" if fn is None else f"{type(fn).__name__} (not a function)"
        raise WorkloadError(f"--model {spec!r}: {where} has {what} {fn_name!r}{hint}")
    try:
        out = fn()
    except SystemExit as e:  # sys.exit() in the user's code: not soapjax's exit
        raise WorkloadError(f"--model {spec!r}: {fn_name}() called sys.exit({e.code!r}) "
                            f"{_where(e)}instead of returning {FORM.split(', ', 1)[1]}") from None
    except Exception as e:  # noqa: BLE001  the user's code failed: say where and why
        raise WorkloadError(f"--model {spec!r}: {fn_name}() raised {_described(e)}") from e
    name = Path(where).stem if where.endswith(".py") else where.rpartition(".")[2]
    return _workload(spec, fn_name, out, name)


def _import_file(spec: str, path: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise WorkloadError(f"--model {spec!r}: no file {str(file)!r} (relative paths start at "
                            f"the current directory, {os.getcwd()})")
    file = file.resolve()
    tag = hashlib.sha256(str(file).encode()).hexdigest()[:8]
    module_name = f"_soapjax_user_{file.stem}_{tag}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickle look modules up by name
    sys.path.insert(0, str(file.parent))
    try:
        module_spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[module_name]
        raise WorkloadError(f"--model {spec!r}: running {file} called sys.exit({e.code!r}) "
                            f"{_where(e)}(a script's main guard missing?)") from None
    except Exception as e:  # noqa: BLE001  the user's file failed to run
        del sys.modules[module_name]
        raise WorkloadError(f"--model {spec!r}: running {file} raised {_described(e)}") from e
    finally:
        sys.path.remove(str(file.parent))
    return module


def _import_module(spec: str, name: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            raise WorkloadError(f"--model {spec!r}: cannot import module {name!r}: no module "
                                f"named {e.name!r} on sys.path (the current directory and "
                                "PYTHONPATH are searched); for a file, give its path, "
                                "path/to/file.py:FUNCTION") from None
        raise WorkloadError(f"--model {spec!r}: importing {name} raised {_described(e)}") from e
    except SystemExit as e:
        raise WorkloadError(f"--model {spec!r}: importing {name} called sys.exit({e.code!r}) "
                            f"{_where(e)}(a script's main guard missing?)") from None
    except Exception as e:  # noqa: BLE001  the user's module failed to import
        raise WorkloadError(f"--model {spec!r}: importing {name} raised {_described(e)}") from e


def _where(e: BaseException) -> str:
    """``(at file.py:12) ``: where the user's code raised `e`, or ''."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"(at {frames[-1].filename}:{frames[-1].lineno}) " if frames else ""


def _described(e: BaseException) -> str:
    """``ValueError: message (at file.py:12)``: the exception and where the user's code was."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


def _workload(spec: str, fn_name: str, out: Any, name: str) -> Workload:
    if not isinstance(out, tuple) or len(out) not in (3, 4):
        found = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise WorkloadError(f"--model {spec!r}: {fn_name}() must return (loss_fn, params or "
                            f"nnx.Module, batch[, optimizer]); it returned {found}")
    loss_fn, params, batch = out[:3]
    optimizer = optax_of(params, out[3]) if len(out) == 4 else optax.adam(1e-3)
    if not callable(loss_fn):
        raise WorkloadError(f"--model {spec!r}: {fn_name}() returned {type(loss_fn).__name__} "
                            "as loss_fn; expected a function loss_fn(params, batch) -> scalar")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise WorkloadError(f"--model {spec!r}: {fn_name}() returned {type(optimizer).__name__} "
                            "as the optimizer; expected an optax GradientTransformation")
    api = "nnx" if isinstance(params, nnx.Module) else "linen"
    loss_fn, params, name = pure_loss(loss_fn, params, name)
    _check_leaves(spec, fn_name, "params", params)
    problem = optimizer_problem(optimizer, params)
    if problem:
        raise WorkloadError(f"--model {spec!r}: the optimizer {fn_name}() returned cannot "
                            f"update its parameters: {problem}")
    _check_leaves(spec, fn_name, "batch", batch)
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise WorkloadError(f"--model {spec!r}: every batch leaf needs the same dim 0 (the "
                            f"batch); found sizes {sorted(sizes, key=str)}")
    return Workload(name=name, config="", api=api, family=None, description=spec,
                    batch_size=sizes.pop(), loss_fn=loss_fn, init_params=_filler(params, 0.02),
                    make_batch=_filler(batch, 1.0,
                                       lambda: index_bounds(loss_fn, params, batch)),
                    optimizer=optimizer,
                    has_aux=_returns_aux(loss_fn, params, batch))


def _returns_aux(loss_fn: Callable, params: Any, batch: Any) -> bool:
    """Whether ``loss_fn`` returns ``(loss, aux)`` (a pair whose first element is a scalar), as
    a training loop's loss with metrics or batch statistics does: planned with
    ``has_aux=True`` (`soapjax.training.shard_training`'s), so its plans bind there. A loss
    that fails here is left to tracing, which says why."""
    try:
        out = jax.eval_shape(loss_fn, params, batch)
    except Exception:  # noqa: BLE001 - tracing reports the user's error with its context
        return False
    return (isinstance(out, (tuple, list)) and len(out) == 2
            and getattr(out[0], "shape", None) == ())


def _check_leaves(spec: str, fn_name: str, what: str, tree: Any) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        raise WorkloadError(f"--model {spec!r}: {fn_name}() returned {what} with no arrays")
    for path, x in leaves:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise WorkloadError(f"--model {spec!r}: {what} leaf {jax.tree_util.keystr(path)} "
                                f"is {type(x).__name__}; expected an array or a "
                                "jax.ShapeDtypeStruct")


def _filler(tree: Any, scale: float,
            bounds: Callable[[], Sequence[int | None]] = tuple) -> Callable[[jax.Array], Any]:
    """``fn(rng)``: the tree itself where it holds arrays, else drawn values of its shapes:
    floats normal times `scale`, integers uniform below their leaf's bound in ``bounds()``
    (leaf order; `index_bounds`, worked out at the first draw: loading a workload traces
    nothing for it), else zeros."""
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
        return lambda rng: tree
    bounds = functools.cache(bounds)

    def draw(rng: jax.Array) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        keys = jax.random.split(rng, len(leaves))
        limits = list(bounds()) + [None] * (len(leaves) - len(bounds()))
        return jax.tree.unflatten(treedef, [_draw(k, x, scale, b)
                                            for k, x, b in zip(keys, leaves, limits)])

    return draw


def _draw(key: jax.Array, x: Any, scale: float, bound: int | None = None) -> jax.Array:
    if not isinstance(x, jax.ShapeDtypeStruct):
        return x
    if jnp.issubdtype(x.dtype, jnp.floating):
        return (scale * jax.random.normal(key, x.shape)).astype(x.dtype)
    if bound and jnp.issubdtype(x.dtype, jnp.integer):
        return jax.random.randint(key, x.shape, 0, bound, x.dtype)
    return jnp.zeros(x.shape, x.dtype)


# What an index may go through on its way to a gather and stay an index: shape moves, a
# negative index's wrap-around (``where(i < 0, i + n, i)``), index vectors built by concatenation.
_INDEX_MOVES = {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice",
                "copy", "copy_p", "concatenate", "select_n", "add", "sub", "dynamic_slice",
                "convert_element_type", "rev"}
_COMPARES = {"eq", "ne", "lt", "le", "gt", "ge"}


def index_bounds(loss_fn: Callable, params: Any, batch: Any) -> list[int | None]:
    """Per batch leaf (``jax.tree.leaves`` order), the count an integer leaf's values may be
    drawn below, where the loss reads it only as indices (the tokens an embedding gathers,
    the labels a cross-entropy picks by ``take_along_axis`` or compares with a one-hot's
    iota) and in comparisons: the smallest such count over its uses. None (draw zeros) for a
    float leaf, or an integer one used otherwise (arithmetic, a cast to float, a carry).

    Drawn tokens all zero make every position of a language model alike, so its attention's
    query and key gradients are zero and `soapjax check` cannot see them split wrongly. An
    index shifted by a sum (``i + n``: how ``jnp`` wraps a negative index) is taken for the
    index it was: a loss that gathers at ``ids + 1`` may draw one past its table's end (a
    gather then clamps or fills, as jax's gathers do); pass such a batch itself.

    >>> import jax, jax.numpy as jnp
    >>> table = jax.ShapeDtypeStruct((50, 4), jnp.float32)
    >>> ids = jax.ShapeDtypeStruct((8, 3), jnp.int32)
    >>> index_bounds(lambda p, b: p[b["ids"]].sum() * b["n"].sum(), table,
    ...              {"ids": ids, "n": ids})
    [50, None]
    """
    try:
        closed = jax.make_jaxpr(loss_fn)(params, batch)
    except Exception:  # noqa: BLE001  (tracing reports the user's error with its context)
        return [None] * len(jax.tree.leaves(batch))
    jaxpr = closed.jaxpr
    ins = jaxpr.invars[len(jax.tree.leaves(params)):]
    return [_bound(jaxpr, {v}) if jnp.issubdtype(x.dtype, jnp.integer) else None
            for v, x in zip(ins, jax.tree.leaves(batch))]


def _bound(jaxpr: Any, held: set) -> int | None:
    """The smallest count the values of `held` (variables of `jaxpr`) index; None where one
    of them is used other than as an index or in a comparison, or indexes nothing."""
    found: list[int] = []
    if not _uses(jaxpr, set(held), found):
        return None
    return min(found) if found and min(found) > 1 else None


def _uses(jaxpr: Any, held: set, found: list[int]) -> bool:
    """Walks `jaxpr`, adding to `held` what an index becomes and to `found` the counts it
    indexes; False at a use that is not an index's (`_bound`)."""
    for eqn in jaxpr.eqns:
        used = [k for k, v in enumerate(eqn.invars) if not _literal(v) and v in held]
        if not used:
            continue
        name = eqn.primitive.name
        subs = _called(eqn)
        if name in _COMPARES:  # a one-hot's ``eq`` with an iota: an index below its length
            other = eqn.invars[1 - used[0]] if len(eqn.invars) == 2 else None
            n = _iota_size(jaxpr, other) if name == "eq" else None
            if n:
                found.append(n)
        elif name == "gather" and used == [1]:
            dims = eqn.params["dimension_numbers"].start_index_map
            shape, sizes = eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
            found.append(min(shape[d] - sizes[d] + 1 for d in dims))
        elif name == "dynamic_slice" and 0 not in used:
            continue  # start indices: clamped into range
        elif name in _INDEX_MOVES and all(jnp.issubdtype(v.aval.dtype, jnp.integer)
                                           for v in eqn.outvars):
            held.update(eqn.outvars)
        elif len(subs) == 1 and len(subs[0].invars) == len(eqn.invars) \
                and len(subs[0].outvars) == len(eqn.outvars) and name != "while":
            inner = {subs[0].invars[k] for k in used}
            if not _uses(subs[0], inner, found):
                return False
            held.update(o for o, i in zip(eqn.outvars, subs[0].outvars) if i in inner)
        else:
            return False
    return True


def _called(eqn: Any) -> list:
    return list(jcore.jaxprs_in_params(eqn.params))


def _literal(v: Any) -> bool:
    return isinstance(v, jcore.Literal)


def _iota_size(jaxpr: Any, v: Any) -> int | None:
    """The length of the iota `v` is (through broadcasts and shape moves), or None."""
    while v is not None and not _literal(v):
        eqn = next((e for e in jaxpr.eqns if v in e.outvars), None)
        if eqn is None:
            return None
        if eqn.primitive.name == "iota":
            return eqn.params["shape"][eqn.params["dimension"]]
        if eqn.primitive.name not in ("broadcast_in_dim", "reshape", "convert_element_type",
                                      "expand_dims"):
            return None
        v = eqn.invars[0]
    return None
