"""Deadlines of a search's time budget: whether one is past, and equal shares of what is left;
and the garbage collector kept off what was there before the search, and run less often
within it (`sparse_gc`).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

__all__ = ["past", "share", "sparse_gc"]

_sparse = 0  # how many `sparse_gc` blocks are open
_YOUNG = 20_000  # allocations (net of frees) between collections of the youngest generation


@contextlib.contextmanager
def sparse_gc() -> Iterator[None]:
    """Within the block, Python's cyclic garbage collector leaves alone every object that
    existed when the outermost block began (`gc.freeze`; `gc.unfreeze` after it, unless the
    process had frozen objects itself before, which then stay as they were), and collects
    its youngest generation after 20,000 net allocations instead of 700 (the thresholds are
    restored after it).

    A search allocates small lists and tuples by the million (every proposal builds tasks),
    so the collector ran often, and each full collection walked the whole heap: the traced
    graph, its jaxprs, JAX's caches. Objects made within the block are collected as always,
    a little later.
    """
    global _sparse
    if _sparse == 0:
        # a process that froze objects itself (a server that forks) keeps them frozen
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        before = gc.get_threshold()
        gc.set_threshold(max(before[0], _YOUNG), *before[1:])
    _sparse += 1
    try:
        yield
    finally:
        _sparse -= 1
        if _sparse == 0:
            gc.set_threshold(*before)
            if freeze:
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

