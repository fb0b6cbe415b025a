"""Whether a file can be written at a path, as far as can be told without writing it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["unwritable"]


def unwritable(path: str | os.PathLike) -> tuple[str, Path]:
    """Why no file can be written at `path`, and the folder that says so: ``("directory",
    path)`` when it is a directory, ``("not a directory", folder)`` or ``("not writable",
    folder)`` for its nearest existing folder (missing folders are made on writing), else
    ``("", folder)``."""
    p = Path(path)
    if p.is_dir():
        return "directory", p
    folder = p.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return "not a directory", folder
    if not os.access(folder, os.W_OK | os.X_OK):
        return "not writable", folder
    return "", folder
