"""Checkpoints of a sharded training run: saved with orbax, restored under any plan or mesh.

A checkpoint holds the parameters and the optimizer state in the model's layout (an interleaved
pipeline's step keeps its stacked layer parameters in chunk order: `save` writes them in the
model's order and `restore` puts them back in the run's: `soapjax.apply.model_layout`,
`soapjax.apply.step_layout`), each array as its global value, so it
restores under another plan, another mesh or another number of devices: `restore` reads every
array straight onto the shardings of the run it is given (orbax reads each device's shard).

`save` writes ``DIRECTORY/step_NNNNNNNN`` through orbax, which writes into a temporary folder
and renames it only once every array is on disk: a process killed during a save leaves the
previous checkpoints as they were, and `latest_step` and `restore` see only finished ones.
Orbax is the JAX ecosystem's checkpoint library, already installed with Flax.

Example (a loop that resumes)::

    run = shard_training(loss_fn, params, batch, optimizer, mesh="cpu8")
    params, opt_state = run.params, run.opt_state
    start = checkpoint.latest_step(ckpt_dir) or 0
    if start:
        params, opt_state = checkpoint.restore(ckpt_dir, run, start)
    for step in range(start + 1, steps + 1):
        params, opt_state, loss = run.step(params, opt_state, run.shard_batch(next_batch()))
        if step % 100 == 0:
            checkpoint.save(ckpt_dir, run, step, params=params, opt_state=opt_state)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from soapjax.apply.step import model_layout, step_layout
from soapjax.base.errors import PlanError
from soapjax.training import ShardedTraining

__all__ = ["latest_step", "restore", "save", "steps"]

_STEP = re.compile(r"step_(\d{8})")


def save(directory: str | os.PathLike, run: ShardedTraining, step: int, *,
         params: Any = None, opt_state: Any = None) -> Path:
    """Saves `run`'s parameters and optimizer state (or the `params` and `opt_state` given, on
    the run's shardings) as checkpoint `step` under `directory`; returns its folder. Every
    process calls it alike in a multi-process run (orbax writes each one's shards).

    Raises:
      PlanError: a negative step, or a step already saved there.
    """
    if not isinstance(step, int) or step < 0:
        raise PlanError(f"checkpoint step: expected an int >= 0, got {step!r}")
    path = _folder(directory, step)
    if path.exists():
        raise PlanError(f"checkpoint {path} exists already; save under a new step, or remove it")
    state = model_layout({"params": run.params if params is None else params,
                          "opt_state": run.opt_state if opt_state is None else opt_state})
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    checkpointer.close()
    return path


def restore(directory: str | os.PathLike, run: ShardedTraining, step: int | None = None
            ) -> tuple[Any, Any]:
    """``(params, opt_state)`` of checkpoint `step` (default: the latest) under `directory`,
    on `run`'s shardings: `run` may be another plan's, mesh's or device count's than the one
    that saved, of the same model and optimizer.

    Raises:
      PlanError: no finished checkpoint there (or not that step), or one of another model or
        optimizer (its arrays' shapes, dtypes or structure differ from `run`'s).
    """
    if step is None:
        step = latest_step(directory)
        if step is None:
            raise PlanError(f"no checkpoint under {directory}; expected the folder "
                            "soapjax.checkpoint.save wrote step_NNNNNNNN folders into")
    path = _folder(directory, step)
    if step not in steps(directory):
        raise PlanError(f"no finished checkpoint {path}; the ones there: "
                        f"{', '.join(map(str, steps(directory))) or 'none'}")
    # the model's layout (stacked layers in the model's order), then the run's
    target = model_layout({"params": _abstract(run.params, run.shardings.params),
                           "opt_state": _abstract(run.opt_state, run.shardings.opt_state)})
    checkpointer = ocp.StandardCheckpointer()
    try:
        restored = checkpointer.restore(path, target)
    except (ValueError, KeyError, TypeError) as e:
        raise PlanError(f"checkpoint {path} does not fit this run (another model or "
                        f"optimizer?): {str(e).splitlines()[0][:300]}") from None
    finally:
        checkpointer.close()
    return (step_layout(restored["params"], run.shardings.params),
            step_layout(restored["opt_state"], run.shardings.opt_state))


def steps(directory: str | os.PathLike) -> tuple[int, ...]:
    """The finished checkpoints' steps under `directory`, sorted (a save cut short leaves only
    orbax's temporary folder, which is not one)."""
    root = Path(directory)
    if not root.is_dir():
        return ()
    return tuple(sorted(int(m.group(1)) for p in root.iterdir()
                        if (m := _STEP.fullmatch(p.name)) and ocp.utils.is_checkpoint_finalized(p)))


def latest_step(directory: str | os.PathLike) -> int | None:
    """The latest finished checkpoint's step under `directory`, or None."""
    found = steps(directory)
    return found[-1] if found else None


def _folder(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory).resolve() / f"step_{step:08d}"


def _abstract(tree: Any, shardings: Any) -> Any:
    """Each array of `tree` as a `jax.ShapeDtypeStruct` on its sharding in `shardings`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
