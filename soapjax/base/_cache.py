"""Where soapjax keeps its on-disk caches: one root, one folder per kind.

``$SOAPJAX_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/soapjax``, else ``~/.cache/soapjax``.
Under it, one folder per kind: ``costs/`` (measured operator times, `soapjax.cost.operators`),
``reshard/`` (XLA's resharding collectives, `soapjax.cost.reshard`) and ``plans/`` (the training
helper's searched plans, `soapjax.training`). Every cache treats an unreadable or corrupt entry
as a miss, with a warning, and rewrites it.

>>> cache_root("~/my-cache") == Path.home() / "my-cache"  # a folder given wins
True
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "SOAPJAX_CACHE_DIR"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` if given, else the soapjax cache root (see the module doc)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if env := os.environ.get(ENV):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "soapjax"
