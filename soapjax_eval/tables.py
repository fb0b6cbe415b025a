"""Small helpers shared by the sections' prose and the figures: numbers as text, Markdown
tables, rank correlation, and reading a throughput row."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:,.0f}"


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def gb(x: float) -> str:
    """Bytes in GB with three significant digits (tiny runs move kilobytes)."""
    return f"{x / 1e9:.3g}"


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank); nan for fewer than 2 points."""
    if len(x) < 2:
        return float("nan")

    def ranks(v: list[float]) -> np.ndarray:
        v = np.asarray(v, float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):
            tied = v == value
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def throughput(entry: dict | None, batch: int) -> float | None:
    if entry is None:
        return None
    return batch / entry["step_time_s"]


def expert_name(row: dict) -> str | None:
    return {"cnn": "expert-cnn", "rnn": "expert-rnn"}.get(row["family"])


def by_cluster(rows: list[dict]) -> dict[str, list[dict]]:
    """Throughput rows grouped by cluster (``p100x16``, ``k80x64``, ``h100``), in row order."""
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["cluster"], []).append(row)
    return out
