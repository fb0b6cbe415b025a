"""Stage simulations shared by the pipelines of one search (`StagePool`).

A `soapjax.simulate.pipesim.PipelinedSimulation` prices its stages with one simulation of the
whole graph on one stage's devices (a `Simulation`, or a `FoldedStage`), which sees the stage's
strategy without the pipeline's virtual stages, schedule or stage layers. A search scores
Megatron's grid at every interleave and schedule of a stage count, so each pipeline would build
the same one-stage simulation at the same grid points again (GPT 1T on 3,072 A100s: 1,268 of
2,360 folded-stage builds, docs/vs-experts.md). With a pool, the pipelines at one stage count
share one, and each takes it (`SharedStage.take`) before it reads or changes it: the one-stage
simulation is reset to the taker's strategy where another pipeline left it elsewhere (a
simulation reset to the strategy it holds returns at once), so each pipeline reads what a
simulation of its own would hold (full simulation is a pure function of the strategy, and
delta == full).

Not thread-safe, as the simulations are not; a forked search lane works on its own copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, Self

from soapjax.cost.reshard import Resharder
from soapjax.strategy.space import MeshShape, Strategy

__all__ = ["SharedStage", "StagePool"]


class SharedStage:
    """One stage simulation (`sim`) and the pipeline whose strategy it holds (its owner).

    Every other pipeline that shares it is remembered with the strategy it had when it last
    held it, and gets it back when it takes the simulation again."""

    def __init__(self, sim: Any, owner: object) -> None:
        self.sim = sim
        self._owner: object | None = owner
        self._held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def join(self, owner: object, strategy: Strategy) -> None:
        """`owner` shares the simulation from now on, its strategy `strategy` (one-stage)."""
        if owner is not self._owner:
            self._held[owner] = strategy

    def take(self, owner: object) -> Any:
        """The simulation at `owner`'s strategy: reset to it where another pipeline holds it
        (a proposal of that pipeline still pending raises, as `Simulation.reset` does, and
        changes nothing)."""
        if self._owner is not owner:
            self._hand_over(owner, self._held[owner])
        return self.sim

    def reset(self, owner: object, strategy: Strategy) -> Any:
        """`owner` takes the simulation at `strategy` (its new one); returns it."""
        if self._owner is not owner:
            self._hand_over(owner, strategy)
        else:
            self.sim.reset(strategy)
        return self.sim

    def _hand_over(self, owner: object, strategy: Strategy) -> None:
        """The simulation reset to `strategy` for `owner`, the last owner's strategy kept
        for its next `take`."""
        left = self.sim.strategy if self._owner is not None else None
        self.sim.reset(strategy)  # raises under a pending proposal: nothing changed then
        if left is not None:
            self._held[self._owner] = left
        self._held.pop(owner, None)
        self._owner = owner


class StagePool:
    """The stage simulations the pipelines of one search share, one per key (module doc), and
    the resharders they price with, one per stage mesh and mode; `close` (or the end of a
    ``with`` block) closes the resharders.

    >>> pool = StagePool()
    >>> pool.resharder(MeshShape(("data",), (2,)), "ideal") is pool.resharder(
    ...     MeshShape(("data",), (2,)), "ideal")
    True
    >>> pool.close()
    """

    def __init__(self) -> None:
        self._stages: dict[Hashable, tuple[SharedStage, tuple]] = {}
        self._resharders: dict[tuple[MeshShape, str], Resharder] = {}

    def stage(self, key: Hashable, keep: tuple, make: Callable[[], Any], owner: object,
              strategy: Strategy) -> SharedStage:
        """The shared stage simulation under `key`, `owner` joined to it at `strategy`; made
        by `make()` (`owner` its first holder) where the pool has none yet. `keep`: the
        objects whose ids `key` holds, kept alive with the entry (so no id is reused)."""
        found = self._stages.get(key)
        if found is None:
            shared = SharedStage(make(), owner)
            self._stages[key] = (shared, keep)
            return shared
        found[0].join(owner, strategy)
        return found[0]

    def resharder(self, mesh: MeshShape, mode: str) -> Resharder:
        """The pool's resharder for `mesh` in `mode` (made at the first call)."""
        key = (mesh, mode)
        if key not in self._resharders:
            self._resharders[key] = Resharder(mesh, mode=mode)
        return self._resharders[key]

    def close(self) -> None:
        """Closes the resharders and forgets the simulations."""
        for resharder in self._resharders.values():
            resharder.close()
        self._resharders.clear()
        self._stages.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
