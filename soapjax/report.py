"""Readable text for plans: per-layer configs grouped by module, baselines, bytes, memory."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from soapjax.graph import OpGraph
from soapjax.space import Strategy

# The block index of a repeated module: the first path component ending in _N with more after
# it (`layers_3/mlp/fc1`, `layer2_0/conv1`), not a leaf's own number (`ln_1`).
_INDEX = re.compile(r"^([^/]*?_)(\d+)(?=/)")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def grouped_configs(graph: OpGraph, strategy: Strategy) -> list[tuple[str, int, str]]:
    """(operator name pattern, count, config) rows; a repeated block is one row.

    ``layers_0/mlp/fc1`` ... ``layers_11/mlp/fc1`` with the same config read as
    ``layers_{0..11}/mlp/fc1`` with a count of 12.
    """
    rows: dict[tuple[str, str], list[str]] = {}
    order: list[tuple[str, str]] = []
    for op, config in zip(graph.operators, strategy.configs):
        key = (_INDEX.sub(r"\1*", op.name), config.describe(op))
        if key not in rows:
            rows[key] = []
            order.append(key)
        rows[key].append(op.name)
    out = []
    for key in order:
        names = rows[key]
        if len(names) == 1:
            out.append((names[0], 1, key[1]))
            continue
        indices = [int(m.group(2)) for n in names if (m := _INDEX.search(n))]
        span = f"{{{min(indices)}..{max(indices)}}}" if indices else "*"
        out.append((_INDEX.sub(lambda m: m.group(1) + span, names[0], count=1), len(names), key[1]))
    return out


def plan_report(graph: OpGraph, topology, strategy: Strategy, sim, *,
                baselines: Sequence[tuple[str, float, bool]], header: Sequence[str] = ()) -> str:
    """The text `soapjax plan` prints."""
    lines = list(header)
    lines.append("")
    lines.append("per-layer configs (each output dim: role, mesh axes; after | the reduction "
                 "dims split, R)")
    rows = grouped_configs(graph, strategy)
    width = max(len(n) + (5 if c > 1 else 0) for n, c, _ in rows)
    for name, count, desc in rows:
        label = name + (f" x{count}" if count > 1 else "")
        lines.append(f"  {label:<{width}}  {desc}")
    if strategy.zero_axes:
        lines.append(f"  parameters, gradients and optimizer state sharded over "
                     f"{', '.join(strategy.zero_axes)} (ZeRO-3)")
    lines.append("")
    lines.append("predicted step time")
    t = sim.step_time_s
    lines.append(f"  {'soapjax plan':<16} {t * 1e3:10.3f} ms")
    for name, bt, fits in sorted(baselines, key=lambda b: b[1]):
        note = "" if fits else "  (does not fit in memory)"
        lines.append(f"  {name:<16} {bt * 1e3:10.3f} ms  {bt / t:5.2f}x the plan's time{note}")
    lines.append("")
    by_class = ", ".join(f"{k} {_bytes(v)}" for k, v in sorted(_items(sim.bytes_by_link_class)))
    lines.append(f"bytes moved per device per step: {_bytes(sim.bytes_moved)}"
                 + (f" ({by_class})" if by_class else ""))
    lines.append(f"compute {sim.compute_s * 1e3:.3f} ms, exposed communication "
                 f"{sim.exposed_comm_s * 1e3:.3f} ms")
    m = sim.memory
    lines.append(f"memory per device: {_gib(m.total)} of {_gib(sim.memory_capacity_bytes)} "
                 f"(parameters {_gib(m.params)}, gradients {_gib(m.grads)}, optimizer "
                 f"{_gib(m.opt_state)}, activations {_gib(m.activations)}, buffers "
                 f"{_gib(m.comm_buffers)}); same on all {sim.num_devices} devices (SPMD)")
    return "\n".join(lines)


def _items(x: Mapping | Sequence) -> list:
    return list(x.items()) if isinstance(x, Mapping) else list(x)
