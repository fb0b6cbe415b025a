"""Deadlines of a search's time budget: whether one is past, and equal shares of what is left.
"""

from __future__ import annotations

import time

__all__ = ["past", "share"]


def past(deadline: float | None) -> bool:
    """Whether `deadline` (a `time.perf_counter` time, or None: never) has passed."""
    return deadline is not None and time.perf_counter() >= deadline



def share(end: float | None, parts: int) -> float | None:
    """The deadline of the first of `parts` equal shares of the time left before `end`."""
    if end is None:
        return None
    now = time.perf_counter()
    return now + max(end - now, 0.0) / parts

