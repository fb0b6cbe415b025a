"""Deadlines of a search's time budget: whether one is past, and equal shares of what is left;
and the garbage collector kept off what was there before the search (`gc_frozen`).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

__all__ = ["gc_frozen", "past", "share"]

_frozen = 0  # how many `gc_frozen` blocks are open


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Within the block, Python's cyclic garbage collector leaves alone every object that
    existed when the outermost block began (`gc.freeze`; `gc.unfreeze` after it).

    A search allocates small lists and tuples by the million (every proposal builds tasks),
    so the collector runs often, and each full collection walked the whole heap: the traced
    graph, its jaxprs, JAX's caches. Objects made within the block are collected as always.
    """
    global _frozen
    if _frozen == 0:
        gc.freeze()
    _frozen += 1
    try:
        yield
    finally:
        _frozen -= 1
        if _frozen == 0:
            gc.unfreeze()


def past(deadline: float | None) -> bool:
    """Whether `deadline` (a `time.perf_counter` time, or None: never) has passed."""
    return deadline is not None and time.perf_counter() >= deadline


def share(end: float | None, parts: int) -> float | None:
    """The deadline of the first of `parts` equal shares of the time left before `end`."""
    if end is None:
        return None
    now = time.perf_counter()
    return now + max(end - now, 0.0) / parts

