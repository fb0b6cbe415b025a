"""Readable text and notebook HTML for plans, graphs and simulated steps, grouped by module.

`register_html_reprs` gives `Plan`, `OpGraph` and `SimResult` their notebook HTML
(`_repr_html_`); ``import soapjax`` calls it. The classes' own modules stay below this one in the
import order (graph -> plan -> report), so none of them imports report, and importing report
changes no class.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from html import escape

from soapjax.graph.opgraph import OpGraph
from soapjax.simulate.front import SimResult
from soapjax.strategy.memory import recomputes
from soapjax.strategy.plan import Plan, spec_text
from soapjax.strategy.space import Strategy, to_partition_spec

__all__ = ["byte_unit", "format_bytes", "graph_html", "group_repeats", "grouped_configs",
           "grouped_table_html", "plan_html", "plan_report", "register_html_reprs", "sent_bytes",
           "sim_html", "step_terms"]

# The block index of a repeated module: the first path component ending in _N with more after
# it (`layers_3/mlp/fc1`, `layer2_0/conv1`), or a bare number (`3/mlp/fc1`: list-held layers),
# not a leaf's own number (`ln_1`).
_INDEX = re.compile(r"^([^/]*?_|)(\d+)(?=/)")


def byte_unit(n: float) -> tuple[str, float]:
    """The decimal unit (and its size in bytes) that shows `n` bytes as 1 to 999 of it.

    >>> byte_unit(3.2e8)
    ('MB', 1000000.0)
    """
    return next(((u, v) for u, v in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if n >= v),
                ("B", 1.0))


def format_bytes(n: float) -> str:
    """Bytes in decimal units, four significant digits: how soapjax prints every size.

    >>> format_bytes(1234567), format_bytes(12), format_bytes(2 * 2**30)
    ('1.235 MB', '12 B', '2.147 GB')
    """
    unit, scale = byte_unit(n)
    return f"{n / scale:.4g} {unit}"


def group_repeats(items: Sequence[tuple[str, Hashable]]) -> list[tuple[str, list[int]]]:
    """(name pattern, indices) of (name, key) items; a repeated block with one key is one row.

    ``layers_0/mlp/fc1`` ... ``layers_11/mlp/fc1`` with equal keys read as
    ``layers_{0..11}/mlp/fc1`` with indices of all twelve; rows keep first-appearance order.
    """
    rows: dict[tuple[str, Hashable], list[int]] = {}
    for i, (name, key) in enumerate(items):
        rows.setdefault((_INDEX.sub(r"\1*", name), key), []).append(i)
    out = []
    for indices in rows.values():
        names = [items[i][0] for i in indices]
        if len(names) == 1:
            out.append((names[0], indices))
            continue
        blocks = [int(m.group(2)) for n in names if (m := _INDEX.search(n))]
        span = f"{{{min(blocks)}..{max(blocks)}}}" if blocks else "*"
        out.append((_INDEX.sub(lambda m: m.group(1) + span, names[0], count=1), indices))
    return out


def grouped_configs(graph: OpGraph, strategy: Strategy) -> list[tuple[str, int, str]]:
    """(operator name pattern, count, config) rows; a repeated block is one row.

    ``layers_0/mlp/fc1`` ... ``layers_11/mlp/fc1`` with the same config read as
    ``layers_{0..11}/mlp/fc1`` with a count of 12. An operator its recompute policy recomputes
    in the backward pass (`soapjax.strategy.memory.recomputes`) says so after its config
    (``recomputed (full)``); the others keep what their backward reads.
    """
    descs = [c.describe(op) + (f"  recomputed ({strategy.recompute_of(j)})"
                               if recomputes(op, strategy.recompute_of(j)) else "")
             for j, (op, c) in enumerate(zip(graph.operators, strategy.configs))]
    items = [(op.name, d) for op, d in zip(graph.operators, descs)]
    return [(name, len(ix), descs[ix[0]]) for name, ix in group_repeats(items)]


def _state_notes(zero_axes: Sequence[str], optimizer_axes: Sequence[str], ring: bool,
                 esc=lambda text: text) -> list[str]:
    """A line each for ZeRO-3, the distributed optimizer and ring attention, where used."""
    out = []
    if zero_axes:
        out.append("parameters, gradients and optimizer state sharded over "
                   f"{esc(', '.join(zero_axes))} (ZeRO-3)")
    if optimizer_axes:
        out.append(f"optimizer state sharded over {esc(', '.join(optimizer_axes))} "
                   "(distributed optimizer)")
    if ring:
        out.append("context-parallel attention as a ring (keys and values passed around)")
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
    lines += ["  " + line for line in _state_notes(strategy.zero_axes, strategy.optimizer_axes,
                                                  strategy.ring_attention)]
    if strategy.microbatches > 1 and strategy.stages == 1:
        lines.append(f"  gradients accumulated over {strategy.microbatches} microbatches of "
                     f"{graph.batch_size // strategy.microbatches} samples")
    lines.append("")
    lines.append("predicted step time")
    t = sim.step_time_s
    width = max([16] + [len(name) for name, _, _ in baselines])
    lines.append(f"  {'soapjax plan':<{width}} {t * 1e3:10.3f} ms")
    for name, bt, fits in sorted(baselines, key=lambda b: b[1]):
        note = "" if fits else "  (does not fit in memory)"
        lines.append(f"  {name:<{width}} {bt * 1e3:10.3f} ms  {bt / t:5.2f}x the plan's time"
                     f"{note}")
    lines.append("")
    sent, classes = sent_bytes(sim)
    by_class = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(classes.items()))
    lines.append(f"bytes moved per device per step: {format_bytes(sent)}"
                 + (f" ({by_class})" if by_class else ""))
    lines.append(", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in step_terms(sim)))
    m = sim.memory
    lines.append(f"memory per device: {format_bytes(m.total)} of "
                 f"{format_bytes(sim.memory_capacity_bytes)} (parameters {format_bytes(m.params)}, "
                 f"gradients {format_bytes(m.grads)}, optimizer {format_bytes(m.opt_state)}, "
                 f"activations {format_bytes(m.activations)}, buffers "
                 f"{format_bytes(m.comm_buffers)}"
                 + (f", constants {format_bytes(m.constants)}" if m.constants else "") + "); "
                 + (f"same on all {sim.num_devices} devices (SPMD)" if sim.pipeline is None
                    else "the fullest stage's (each stage's: the pipeline line)"))
    return "\n".join(lines)


def _items(x: Mapping | Sequence) -> list:
    return list(x.items()) if isinstance(x, Mapping) else list(x)


# --- HTML for notebooks (`_repr_html_` of Plan, OpGraph and SimResult) -----------------------

def _esc(text: str) -> str:
    return escape(str(text), quote=False)  # text, not attribute values: quotes stay readable


_TABLE = '<table class="soapjax" style="border-collapse:collapse;font-size:90%">'
_LEFT = ' style="text-align:left"'


def _block(name: str) -> tuple[str, str]:
    """A name's top module (``layers_{0..11}``) and the rest (``mlp/fc1``); '' at top level."""
    block, _, rest = name.partition("/")
    return (block, rest) if rest else ("", name)


def grouped_table_html(columns: Sequence[str], rows: Sequence[tuple[str, int, Sequence[str]]],
                       *, code: Sequence[int] = ()) -> str:
    """An HTML table of (name pattern, count, cells) rows under one header row per top module.

    Rows keep their order within a module; modules come in order of first appearance. Every
    text is escaped. `code` lists the cell columns to set in monospace (PartitionSpecs).
    """
    groups: dict[str, list[tuple[str, int, Sequence[str]]]] = {}
    for name, count, cells in rows:
        block, leaf = _block(name)
        groups.setdefault(block, []).append((leaf, count, cells))
    out = [_TABLE, "<thead><tr>"]
    out += [f"<th{_LEFT}>{_esc(c)}</th>" for c in ("operator", "\u00d7", *columns)]
    out.append("</tr></thead><tbody>")
    width = len(columns) + 2
    for block, members in groups.items():
        if block:
            out.append(f'<tr><th colspan="{width}"{_LEFT}>{_esc(block)}/</th></tr>')
        indent = ' style="text-align:left;padding-left:1.5em"' if block else _LEFT
        for leaf, count, cells in members:
            tds = [f"<code>{_esc(c)}</code>" if k in code else _esc(c)
                   for k, c in enumerate(cells)]
            out.append(f"<tr><td{indent}>{_esc(leaf)}</td><td>{count if count > 1 else ''}"
                       "</td>" + "".join(f"<td{_LEFT}>{t}</td>" for t in tds) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _configs_table(names: Sequence[str], specs: Sequence[str], descs: Sequence[str]) -> str:
    items = [(n, (s, d)) for n, s, d in zip(names, specs, descs)]
    rows = [(name, len(ix), items[ix[0]][1]) for name, ix in group_repeats(items)]
    return grouped_table_html(("output PartitionSpec", "config (role:mesh axes | R splits)"),
                              rows, code=(0,))


def plan_html(plan) -> str:
    """A `Plan` as HTML: provenance, predictions against baselines, operators by module."""
    mesh = " \u00d7 ".join(f"{a}={n}" for a, n in zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
    config = f" ({plan.model_config})" if plan.model_config else ""
    lines = [f"<b>soapjax plan</b>: {_esc(plan.model + config)} on {_esc(plan.topology)} "
             f"(mesh {_esc(mesh)}), {plan.num_operators} operators"]
    pred = dict(plan.predicted)
    t = plan.step_time_s
    if t:
        extra = (f", sends {format_bytes(pred['bytes_moved'])} per device"
                 if "bytes_moved" in pred else "")
        lines.append(f"predicted step time {t * 1e3:.4g} ms ({_esc(plan.cost_source)} "
                     f"costs){extra}")
        if pred.get("peak_memory_bytes") and pred.get("memory_capacity_bytes"):
            lines.append(f"memory per device {format_bytes(max(pred['peak_memory_bytes']))} of "
                         f"{format_bytes(pred['memory_capacity_bytes'])}")
        if plan.baselines:
            lines.append("baselines: " + ", ".join(
                f"{_esc(n)} {bt * 1e3:.4g} ms ({bt / t:.2f}\u00d7)"
                for n, bt in sorted(plan.baselines, key=lambda b: b[1])))
    lines += _state_notes(plan.zero_axes, plan.optimizer_axes, plan.ring_attention, _esc)
    names = [n for n, _ in plan.configs]
    if plan.roles:
        specs = [spec_text(s) for s in plan.output_specs().values()]
        table = _configs_table(names, specs, [plan.describe(k) for k in range(len(names))])
    else:  # an older file: no roles, so no split between output and reduction dims
        items = [(n, ("[" + ", ".join("+".join(a) or "-" for a in c.axes) + "]",))
                 for n, c in plan.configs]
        rows = [(name, len(ix), items[ix[0]][1]) for name, ix in group_repeats(items)]
        table = grouped_table_html(("mesh axes per dim",), rows, code=(0,))
    params = "".join(f"<tr><td{_LEFT}>{_esc(path)}</td><td{_LEFT}><code>"
                     f"{_esc(spec_text(to_partition_spec(spec)))}</code></td></tr>"
                     for path, spec in plan.params)
    details = (f"<details><summary>parameters: {len(plan.params)} leaves</summary>{_TABLE}"
               f"<tbody>{params}</tbody></table></details>") if plan.params else ""
    return "<div>" + "<br>".join(lines) + table + details + "</div>"


def graph_html(graph: OpGraph) -> str:
    """An `OpGraph` as HTML: its operators by module (repeated blocks collapsed)."""
    def cells(op) -> tuple[str, ...]:
        shape = "[" + ",".join(f"{s}{r}" for s, r in zip(op.shape, op.roles)) + "]"
        red = ",".join(f"{r.size}{r.role}" for r in op.reduction_dims) or "-"
        return (op.anchor + (" (replicate only)" if op.replicate_only else ""), shape, red,
                f"{op.flops / 1e9:.3g}", f"{op.param_bytes / 2**20:.3g}")

    items = [(op.name, cells(op)) for op in graph.operators]
    rows = [(name, len(ix), items[ix[0]][1]) for name, ix in group_repeats(items)]
    total = sum(op.flops for op in graph.operators)
    head = (f"<b>{_esc(graph.name)}</b>: {len(graph.operators)} operators from "
            f"{graph.num_equations} equations; forward {total / 1e9:.3g} GFLOP; batch "
            f"{graph.batch_size}")
    if graph.unsupported:
        head += "<br>replicate-only: " + _esc(", ".join(graph.unsupported))
    table = grouped_table_html(("anchor", "output (roles)", "R dims", "GFLOP", "param MiB"),
                               rows, code=(1,))
    return f"<div>{head}{table}</div>"


def step_terms(sim) -> tuple[tuple[str, float], ...]:
    """A simulated step's time in parts that add up to it, for reports, ``(name, seconds)``:
    compute and exposed communication of a flat step; of a pipelined one, a device's own
    compute (the one-stage simulation's over all the layers, over the stages: what
    `SimResult.compute_s` holds there, which the reports printed beside the step as if one
    device ran every layer) and the rest (the collectives a stage waits on, the bubble, the
    sends, the prologue and the tail)."""
    if sim.pipeline is None:
        return (("compute", sim.compute_s), ("exposed communication", sim.exposed_comm_s))
    compute = sim.compute_s / sim.pipeline.timeline.stages
    return (("compute", compute),
            ("communication, bubble, sends, prologue and tail",
             max(0.0, sim.step_time_s - compute)))


def sent_bytes(sim) -> tuple[float, dict[str, float]]:
    """The bytes a device sends in a simulated step, and by link class: a flat step's
    tasks'; a pipelined step's, the one-stage simulation's over all the layers, over the
    stages (a device's share; what `SimResult.bytes_moved` holds there is every stage's, and
    `PipelineResult.sent_bytes` counts every stage's branches as the compiled program holds
    them, for `soapjax check`)."""
    classes = dict(_items(sim.bytes_by_link_class))
    if sim.pipeline is None:
        return sim.bytes_moved, classes
    stages = sim.pipeline.timeline.stages
    return sim.bytes_moved / stages, {k: v / stages for k, v in classes.items()}


def sim_html(sim) -> str:
    """A `SimResult` as a small HTML table."""
    m = sim.memory
    sent, by_class = sent_bytes(sim)
    links = ", ".join(f"{_esc(k)} {format_bytes(v)}" for k, v in by_class.items())
    rows = [
        ("step time", f"{sim.step_time_s * 1e3:.4g} ms ({_esc(sim.cost_source)} costs)"),
        *((_esc(name), f"{t * 1e3:.4g} ms") for name, t in step_terms(sim)),
        ("sent per device", format_bytes(sent) + (f" ({links})" if links else "")),
        ("memory per device",
         f"{format_bytes(m.total)} of {format_bytes(sim.memory_capacity_bytes)}"
         f"{'' if sim.fits_in_memory else ': DOES NOT FIT'}"),
        ("devices, tasks", f"{sim.num_devices}, {len(sim.tasks)}"),
    ]
    body = "".join(f"<tr><th{_LEFT}>{k}</th><td{_LEFT}>{v}</td></tr>" for k, v in rows)
    return f"{_TABLE}<tbody>{body}</tbody></table>"


# --- notebook display ------------------------------------------------------------------------


def register_html_reprs() -> None:
    """Gives `OpGraph`, `Plan` and `SimResult` their notebook HTML: `graph_html`, `plan_html`
    and `sim_html` as their `_repr_html_`. ``import soapjax`` calls it; calling it again changes
    nothing.

    The HTML is registered from here, so graph, plan and simulate need no import of this module
    (graph -> report -> plan -> graph was the package's one cycle).
    """
    OpGraph._repr_html_ = graph_html
    Plan._repr_html_ = plan_html
    SimResult._repr_html_ = sim_html
