"""A progress line on stderr, for a terminal and for a log alike.

On a terminal (or in a notebook, which draws carriage returns) `print_progress` rewrites one
line in place. Anywhere else (a log file, a pipe, CI) a rewritten line is one endless line of
every status ever written, so it writes whole lines instead: one when the status changes kind
(its text with the numbers taken out) and one every `LOG_EVERY_S` seconds of the same kind.
`end_progress` ends a rewritten line (nothing to end in a log).
"""

from __future__ import annotations

import re
import sys
import time
from typing import TextIO

LOG_EVERY_S = 10.0
WIDTH = 120
_NUMBER = re.compile(r"\d[\d.,:]*")


class _Last:
    """What was written last where the line is not rewritten."""

    kind: str | None = None
    at: float = float("-inf")
    pending: bool = False  # a rewritten line is open on the terminal


def rewrites(stream: TextIO) -> bool:
    """Whether `stream` draws a carriage return as going back to the line's start: a terminal,
    or a Jupyter kernel's stream."""
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):  # a closed or exotic stream
        return False
    return "ipykernel" in sys.modules


def print_progress(line: str) -> None:
    """A progress callback: `line` on stderr (module doc: in place on a terminal, else whole
    lines when the status changes kind or every `LOG_EVERY_S` seconds)."""
    stream = sys.stderr
    if rewrites(stream):
        stream.write("\r" + line[:WIDTH].ljust(WIDTH))
        _Last.pending = True
    else:
        kind, now = _NUMBER.sub("#", line), time.monotonic()
        if kind == _Last.kind and now - _Last.at < LOG_EVERY_S:
            return
        _Last.kind, _Last.at = kind, now
        stream.write(line.rstrip() + "\n")
    stream.flush()


def end_progress() -> None:
    """Ends the rewritten line, where one is open (what follows starts on a line of its own);
    in a log, forgets the last status, so the next run's first line is written."""
    if _Last.pending:
        sys.stderr.write("\n")
        sys.stderr.flush()
    _Last.pending, _Last.kind, _Last.at = False, None, float("-inf")
