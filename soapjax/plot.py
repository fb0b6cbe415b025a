"""Pictures of plans, for notebooks and `soapjax plan --plot` (matplotlib, optional).

* `plan_figure`: the FlexFlow paper's Figures 13 and 14. Each operator is a box with its split
  over the devices drawn inside: rows split the sample (S) and attribute (A) dims, columns the
  parameter (P) dims (reduction dims go with the role of the dim they reduce: a matmul's
  contracting dim against a weight is a column split), and each device has a colour. A cell
  several devices hold (the operator is replicated over the mesh axes its config leaves
  unused) is striped diagonally with their colours, where a split is drawn as separate
  outlined cells; a hatched cell holds partial sums (a reduction dim is split, R).
  `partitions` gives the same grids as data.
* `timeline_figure`: the simulated step as a Gantt chart: one row per device (the compute
  stream; identical on every device under SPMD) and one per link (collectives).
* `comparison_figure`: predicted step time and bytes sent per device, against the baselines.
* `pipeline_figure`: a timed pipeline schedule (`soapjax.strategy.pipeline.time_schedule`): a row
  per device stage (stage 0 on top), a box per forward and per backward labelled with its
  microbatch; the bubble is the empty space.
* `step_timeline_figure`: the one of the two that draws a simulated step: a flat step's
  timeline, a pipelined step's schedule (what `save_pictures` writes as ``NAME-timeline``).

Each function returns a `matplotlib.figure.Figure` that pyplot does not hold on to: a notebook
shows it inline (as the value of a cell), ``fig.savefig("plan.png")`` writes it. matplotlib is
not a dependency of the core; without it these functions raise `MissingDependencyError` saying
``pip install 'soapjax[plot]'``.

Example, Megatron on ``cpu8`` (``data=2 x model=4``): ``fc1`` column parallel
(``[S:data, P:model | R:-]``) is 2 rows x 4 columns, cell (r, c) held by device ``4r + c``;
``fc2`` row parallel (``[S:data, P:- | R:model]``) is the same grid, hatched. Under data
parallelism every operator is 8 rows x 1 column, row r held by device r.

The artists carry gids, so a drawing can be checked: in `plan_figure` the axes of a box have the
box's label as gid (the operator's name, or ``layers_{0..11}/mlp/fc1`` for a repeated block) and
data coordinates with one unit per cell (x: column, y: row, row 0 on top); a cell one device
holds is a `Rectangle` with gid ``"{label}/device {d}"``; in a cell several devices hold
(replicated) each device's diagonal stripes are one `PathPatch` with that gid; each cell's
outline (hatched for partial sums) is a `Rectangle` with gid ``"{label}/cell {row},{col}"``.
In `timeline_figure` each bar collection has gid ``"{track}/{kind}"`` (``"device 0/forward"``,
``"{channel}/grad_sync"``); in `comparison_figure` each bar has gid ``"step time/{name}"`` or
``"bytes sent/{name}"``; in `pipeline_figure` each box is a `Rectangle` with gid
``"stage {s}/{F|B|W} {microbatch}/chunk {c}"`` and its label, if drawn, a text with that gid
plus ``"/label"``.

One module past ~600 lines, on purpose: it is the one module that imports matplotlib (an
optional dependency, `MissingDependencyError` without it), and its figures share the colours,
the gid conventions above and the layout helpers.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from soapjax.base.errors import MissingDependencyError, PlanError, SettingsError
from soapjax.graph.opgraph import OpGraph
from soapjax.report import byte_unit, group_repeats, sent_bytes
from soapjax.simulate.front import SimResult
from soapjax.strategy.pipeline import PipelineTimeline
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import Config, MeshShape, Strategy, validate_config

__all__ = ["MAX_DRAWN_ACTIONS", "Cell", "Partition", "check_picture_path", "comparison_figure",
           "partitions", "pipeline_figure", "plan_figure", "require_matplotlib", "save_pictures",
           "step_timeline_figure", "timeline_figure"]

INSTALL_HINT = "pip install 'soapjax[plot]'"

# One colour per task kind of `soapjax.simulate.front` (its FORWARD, BACKWARD, ... constants).
KIND_COLORS = {
    "forward": "#4c72b0", "backward": "#dd8452", "update": "#55a868", "reshard": "#c44e52",
    "reshard_backward": "#8172b3", "partial_sum": "#937860", "inner_reduce": "#a6761d",
    "inner_reduce_backward": "#e6ab02", "param_gather": "#da8bc3",
    "grad_sync": "#8c8c8c", "update_reduce": "#ccb974",
}


def require_matplotlib(backend: str | None = None):
    """`matplotlib.pyplot`, or MissingDependencyError saying how to install it.

    Args:
      backend: a backend to select first, e.g. ``"Agg"`` to write files without a display.
    """
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError(
            "pictures of plans need matplotlib, which is not installed in this environment; "
            f"install it with: {INSTALL_HINT}") from None
    if backend is not None:
        matplotlib.use(backend)
    import matplotlib.pyplot as plt

    return plt


def _time_unit(seconds: float) -> tuple[float, str]:
    """(scale, unit) to write times up to `seconds` in: s, ms or us."""
    if seconds >= 1.0:
        return 1.0, "s"
    return (1e3, "ms") if seconds >= 1e-3 else (1e6, "\u00b5s")


def _figure(width: float, height: float):
    plt = require_matplotlib()
    fig = plt.figure(figsize=(width, height), layout="constrained")
    plt.close(fig)  # returned, not held by pyplot: a notebook shows it once, as a cell's value
    return fig


# --- partitions -------------------------------------------------------------------------------


class Cell(NamedTuple):
    """One shard of an operator: its row and column in the grid, and the devices holding it."""

    row: int
    col: int
    devices: tuple[int, ...]


class Partition(NamedTuple):
    """How one operator (or a repeated block of operators with one config) is split.

    Attributes:
      label: the operator's name, or a pattern (``layers_{0..11}/mlp/fc1``) for a block.
      operators: the operators it stands for.
      config: the config as text (`Config.describe`), e.g. ``[S:data, P:model | R:-]``.
      rows, cols: the grid: the degree of the S and A splits, of the P splits.
      row_axes, col_axes: the mesh axes of the rows and of the columns, major first.
      reduction_axes: the mesh axes splitting reduction dims (cells hold partial sums).
      cells: every cell, row-major; each device is in exactly one.
    """

    label: str
    operators: tuple[str, ...]
    config: str
    rows: int
    cols: int
    row_axes: tuple[str, ...]
    col_axes: tuple[str, ...]
    reduction_axes: tuple[str, ...]
    cells: tuple[Cell, ...]


class _Op(NamedTuple):
    name: str
    out_roles: str
    red_roles: str
    config: Config


def partitions(graph_or_plan: OpGraph | Plan, strategy: Strategy | Plan | None = None,
               mesh: Any = None, *, collapse_repeats: bool = True) -> list[Partition]:
    """Each operator's split over the devices, as `plan_figure` draws it.

    Args:
      graph_or_plan: a traced `OpGraph` (then give `strategy`), or a `Plan` alone (its file
        records every operator's dim roles).
      strategy: with a graph: a `Strategy` or a `Plan` made for that graph.
      mesh: the mesh the strategy is for: a `Topology` (devices are numbered as in its
        ``device_order``), a `jax.sharding.Mesh` (device ids) or a `MeshShape` (mesh positions,
        row-major). A plan brings its own mesh shape.
      collapse_repeats: one partition for a repeated block (``layers_0..11``) with one config.

    Returns:
      One `Partition` per operator (or block), in graph order.

    Raises:
      PlanError: the strategy does not fit the graph or the mesh, or the plan was made for
        another graph.
    """
    return _partitions(graph_or_plan, strategy, mesh, collapse_repeats)[0]


def _partitions(first, strategy, mesh, collapse: bool) -> tuple[list[Partition], MeshShape]:
    ops, shape, ids = _resolve(first, strategy, mesh)
    if collapse:
        groups = group_repeats([(op.name, (op.out_roles, op.red_roles, op.config)) for op in ops])
    else:
        groups = [(op.name, [i]) for i, op in enumerate(ops)]
    return [_partition(label, [ops[i] for i in ix], shape, ids) for label, ix in groups], shape


def _resolve(first, strategy, mesh) -> tuple[list[_Op], MeshShape, list[int]]:
    if isinstance(first, Plan):
        if strategy is not None:
            raise PlanError("pass a Plan alone, or an OpGraph with a Strategy or Plan; got a "
                            f"Plan and a {type(strategy).__name__}")
        shape = _mesh_shape(mesh, first.mesh)
        ops = [_Op(name, *first.dim_roles(k), c) for k, (name, c) in enumerate(first.configs)]
        return ops, shape, _device_ids(mesh, shape)
    if not isinstance(first, OpGraph):
        raise PlanError(f"expected an OpGraph (with a strategy) or a Plan, got "
                        f"{type(first).__name__}")
    graph = first
    planned = None
    if isinstance(strategy, Plan):
        planned = strategy.mesh
        strategy = strategy.strategy(graph)
    if not isinstance(strategy, Strategy):
        raise PlanError(f"a graph needs a Strategy or a Plan to draw, got "
                        f"{type(strategy).__name__}")
    if mesh is None and planned is None:
        raise PlanError("give the mesh the strategy is for (a Topology, a jax Mesh or a "
                        "MeshShape), e.g. plan_figure(graph, strategy, load_topology('cpu8'))")
    shape = _mesh_shape(mesh, planned)
    if len(strategy.configs) != len(graph.operators):
        raise PlanError(f"the strategy has {len(strategy.configs)} configs but graph "
                        f"{graph.name!r} has {len(graph.operators)} operators")

    for i, config in enumerate(strategy.configs):
        validate_config(graph, i, config, shape)
    ops = [_Op(op.name, "".join(op.roles), "".join(r.role for r in op.reduction_dims), c)
           for op, c in zip(graph.operators, strategy.configs)]
    return ops, shape, _device_ids(mesh, shape)


def _mesh_shape(mesh, planned: MeshShape | None) -> MeshShape:
    shape = MeshShape.of(mesh) if mesh is not None else planned
    if planned is not None and shape != planned:
        raise PlanError(f"the plan is for mesh {dict(zip(planned.axis_names, planned.axis_sizes))}"
                        f", not {dict(zip(shape.axis_names, shape.axis_sizes))}")
    return shape


def _device_ids(mesh, shape: MeshShape) -> list[int]:
    """Device id at each mesh position (row-major)."""
    if hasattr(mesh, "device_order"):  # a Topology
        return list(mesh.device_order)
    devices = getattr(mesh, "devices", None)
    if devices is not None and hasattr(devices, "flat"):  # a jax Mesh
        return [int(d.id) for d in devices.flat]
    return list(range(shape.num_devices))


def _partition(label: str, ops: Sequence[_Op], mesh: MeshShape, ids: Sequence[int]) -> Partition:
    op = ops[0]
    roles = op.out_roles + op.red_roles
    row_axes: list[str] = []
    col_axes: list[str] = []
    for role, axes in zip(roles, op.config.axes):
        (row_axes if role in ("S", "A") else col_axes).extend(axes)
    n = len(op.out_roles)
    reduction = tuple(a for axes in op.config.axes[n:] for a in axes)
    held: dict[tuple[int, int], list[int]] = {}
    for position, coords in enumerate(itertools.product(*map(range, mesh.axis_sizes))):
        at = dict(zip(mesh.axis_names, coords))
        key = (_mixed_radix(at, row_axes, mesh), _mixed_radix(at, col_axes, mesh))
        held.setdefault(key, []).append(ids[position])
    rows, cols = mesh.degree(row_axes), mesh.degree(col_axes)
    cells = tuple(Cell(r, c, tuple(held[r, c])) for r in range(rows) for c in range(cols))
    describe = op.config.describe_roles(tuple(op.out_roles) + ("R",) * len(op.red_roles), n)
    return Partition(label, tuple(o.name for o in ops), describe, rows, cols, tuple(row_axes),
                     tuple(col_axes), reduction, cells)


def _mixed_radix(at: Mapping[str, int], axes: Sequence[str], mesh: MeshShape) -> int:
    """The shard index along `axes` (major first), as a PartitionSpec entry ('a', 'b') splits."""
    v = 0
    for a in axes:
        v = v * mesh.axis_size(a) + at[a]
    return v


# --- plan_figure ------------------------------------------------------------------------------


def plan_figure(graph_or_plan: OpGraph | Plan, strategy: Strategy | Plan | None = None,
                mesh: Any = None, *, collapse_repeats: bool = True, ncols: int | None = None,
                device_labels: bool | None = None, title: str | None = None):
    """Each operator as a box with its split over the devices drawn (paper Figures 13, 14).

    Args:
      graph_or_plan, strategy, mesh, collapse_repeats: as for `partitions`.
      ncols: boxes per row (default: up to 6).
      device_labels: write each device's number in its stripe (default: when they fit).
      title: the figure's title (default: the model, the mesh and how to read the picture).

    Returns:
      A `matplotlib.figure.Figure`.

    Raises:
      MissingDependencyError: matplotlib is not installed.
      PlanError: as `partitions`.
    """
    require_matplotlib()
    parts, shape = _partitions(graph_or_plan, strategy, mesh, collapse_repeats)
    ids = sorted(d for cell in parts[0].cells for d in cell.devices) if parts else []
    colors = _device_colors(ids)
    ncols = max(1, min(ncols or 6, len(parts) or 1))
    nrows = max(1, math.ceil(len(parts) / ncols))
    fig = _figure(2.4 * ncols, 2.5 * nrows + 1.2)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, part in zip(axes.flat, parts):
        _draw_partition(ax, part, colors, device_labels)
    for ax in list(axes.flat)[len(parts):]:
        ax.set_visible(False)
    _device_legend(fig, axes, colors, hatched=any(p.reduction_axes for p in parts))
    model = graph_or_plan.name if isinstance(graph_or_plan, OpGraph) else graph_or_plan.model
    mesh_text = " \u00d7 ".join(f"{a}={n}" for a, n in zip(shape.axis_names, shape.axis_sizes))
    fig.suptitle(title or f"{model} on mesh {mesh_text}\nrows split the sample and attribute "
                 "dims (S, A), columns the parameter dims (P), a colour per device;\nstriped "
                 "cells are replicated over the devices shown, hatched ones hold partial sums "
                 "(R split)", fontsize=9)
    return fig


def _device_colors(ids: Sequence[int]) -> dict[int, tuple]:
    import matplotlib

    n = len(ids)
    if n <= 20:
        cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
        return {d: cmap(k) for k, d in enumerate(ids)}
    cmap = matplotlib.colormaps["turbo"]
    return {d: cmap((k + 0.5) / n) for k, d in enumerate(ids)}


def _draw_partition(ax, part: Partition, colors: Mapping[int, tuple],
                    labels: bool | None) -> None:
    from matplotlib.patches import Rectangle

    stripes = max(len(c.devices) for c in part.cells)
    if labels is None:
        labels = part.rows <= 16 and part.cols * stripes <= 8
    ax.set_gid(part.label)
    ax.set_xlim(0, part.cols)
    ax.set_ylim(part.rows, 0)
    ax.set_xticks([])
    ax.set_yticks([])
    hatch = "///" if part.reduction_axes else None
    for cell in part.cells:
        k = len(cell.devices)
        if k == 1:
            ax.add_patch(Rectangle((cell.col, cell.row), 1, 1, facecolor=colors[cell.devices[0]],
                                   edgecolor="none", gid=f"{part.label}/device {cell.devices[0]}"))
        else:
            _draw_stripes(ax, part.label, cell, colors)
        for s, d in enumerate(cell.devices if labels else ()):
            ax.text(cell.col + (s + 0.5) / k, cell.row + 0.5, str(d), ha="center",
                    va="center", fontsize=7, color="white", fontweight="bold")
        ax.add_patch(Rectangle((cell.col, cell.row), 1, 1, fill=False, edgecolor="black",
                               linewidth=0.8, hatch=hatch,
                               gid=f"{part.label}/cell {cell.row},{cell.col}"))
    count = len(part.operators)
    ax.set_title(part.label + (f" \u00d7{count}" if count > 1 else ""), fontsize=8)
    replicated = f"; replicated {stripes}\u00d7" if stripes > 1 else ""
    ax.set_xlabel(f"{part.config}\ncolumns: {'+'.join(part.col_axes) or '-'}{replicated}",
                  fontsize=7)
    ax.set_ylabel(f"rows: {'+'.join(part.row_axes) or '-'}", fontsize=7)


def _draw_stripes(ax, label: str, cell: Cell, colors: Mapping[int, tuple]) -> None:
    """A cell several devices hold, as diagonal stripes of their colours (at least 6 stripes,
    each device's colour repeated), so it cannot be read as columns of a split."""
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path as MplPath

    k = len(cell.devices)
    bands = k * max(1, math.ceil(6 / k))
    width = 2.0 / bands  # u = x + y runs from 0 to 2 across the cell
    for s, d in enumerate(cell.devices):
        polygons = [_band(j * width, (j + 1) * width) for j in range(s, bands, k)]
        path = MplPath.make_compound_path(*(
            MplPath([(cell.col + x, cell.row + y) for x, y in poly] + [(0, 0)],
                    [MplPath.MOVETO] + [MplPath.LINETO] * (len(poly) - 1) + [MplPath.CLOSEPOLY])
            for poly in polygons))
        ax.add_patch(PathPatch(path, facecolor=colors[d], edgecolor="none",
                               gid=f"{label}/device {d}"))


def _band(lo: float, hi: float) -> list[tuple[float, float]]:
    """The part of the unit square where ``lo <= x + y <= hi``, as a convex polygon."""
    corners = [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0)]
    poly = [p for p in corners if lo <= p[0] + p[1] <= hi]
    for (x0, y0), (x1, y1) in zip(corners, corners[1:] + corners[:1]):
        for u in (lo, hi):  # where the square's edge crosses x + y = u
            u0, u1 = x0 + y0, x1 + y1
            if u0 != u1 and min(u0, u1) < u < max(u0, u1):
                t = (u - u0) / (u1 - u0)
                poly.append((x0 + t * (x1 - x0), y0 + t * (y1 - y0)))
    cx = sum(x for x, _ in poly) / len(poly)
    cy = sum(y for _, y in poly) / len(poly)
    return sorted(poly, key=lambda p: math.atan2(p[1] - cy, p[0] - cx))


def _device_legend(fig, axes, colors: Mapping[int, tuple], hatched: bool) -> None:
    from matplotlib.patches import Patch

    extra = [Patch(facecolor="white", edgecolor="black", hatch="///",
                   label="partial sums (R split)")] if hatched else []
    if len(colors) <= 20:
        handles = [Patch(facecolor=c, label=f"device {d}") for d, c in colors.items()]
        fig.legend(handles=handles + extra, loc="outside lower center", fontsize=7,
                   ncols=min(len(handles) + len(extra), 10))
        return
    import matplotlib
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    mappable = ScalarMappable(Normalize(0, len(colors) - 1), matplotlib.colormaps["turbo"])
    fig.colorbar(mappable, ax=axes, location="bottom", shrink=0.5, label="device")
    if extra:
        fig.legend(handles=extra, loc="outside lower right", fontsize=7)


# --- timeline_figure --------------------------------------------------------------------------


def timeline_figure(result, *, max_devices: int = 8, title: str | None = None):
    """The simulated step as a Gantt chart: a row per device and per link.

    Args:
      result: a `soapjax.simulate.front.SimResult`.
      max_devices: device rows to draw (every device runs the same compute timeline under SPMD).
      title: the figure's title (default: step time and its breakdown).

    Returns:
      A `matplotlib.figure.Figure`; times in ms, or in us for steps under a millisecond. The
      dashed line is the step time, which includes what calling the step costs where the
      topology measured it (`Simulation.call_overhead`): the dotted span after the last task
      (gid ``"call overhead"``), which the title counts apart from the tasks' compute.
    """
    if not hasattr(result, "tasks") or not hasattr(result, "channels"):
        raise PlanError(f"expected a SimResult (soapjax.simulate.front.simulate), got "
                        f"{type(result).__name__}")
    shown = min(result.num_devices, max_devices)
    tracks = [f"device {d}" for d in range(shown)] + list(result.channels)
    scale, unit = _time_unit(result.step_time_s)
    bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for t in result.tasks:
        span = (t.start_s * scale, (t.end_s - t.start_s) * scale)
        where = ([f"device {d}" for d in range(shown)] if t.resources == ("compute",)
                 else t.resources)
        for track in where:
            bars.setdefault((track, t.kind), []).append(span)
    fig = _figure(11, 1.4 + 0.3 * len(tracks))
    ax = fig.subplots()
    row = {track: i for i, track in enumerate(tracks)}
    labelled: set[str] = set()
    for (track, kind), spans in bars.items():
        coll = ax.broken_barh(spans, (row[track] - 0.4, 0.8),
                              facecolors=KIND_COLORS.get(kind, "#bbbbbb"), edgecolor="white",
                              linewidth=0.3, label=kind if kind not in labelled else None)
        coll.set_gid(f"{track}/{kind}")
        labelled.add(kind)
    end = max((t.end_s for t in result.tasks), default=0.0)
    overhead = max(result.step_time_s - end, 0.0)  # calling the step (`call_overhead`)
    if overhead > 0:
        span = ax.axvspan(end * scale, result.step_time_s * scale, facecolor="#eeeeee",
                          edgecolor="#999999", hatch="..", linewidth=0.0,
                          label="call overhead (per step, not a task)")
        span.set_gid("call overhead")
    ax.axvline(result.step_time_s * scale, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(tracks)), tracks, fontsize=7)
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_xlim(0, result.step_time_s * scale * 1.02 or 1)
    ax.set_xlabel(f"time ({unit})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    note = (f"; {shown} of {result.num_devices} devices shown (SPMD: identical)"
            if shown < result.num_devices else "")
    tasks = result.compute_s - overhead
    compute = (f"compute {tasks * scale:.4g} {unit} + call overhead {overhead * scale:.4g} "
               f"{unit}" if overhead > 0 else f"compute {result.compute_s * scale:.4g} {unit}")
    fig.suptitle(title or (
        f"simulated step {result.step_time_s * scale:.4g} {unit}: {compute}, exposed "
        f"communication {result.exposed_comm_s * scale:.4g} {unit} ({result.cost_source} "
        f"costs){note}"), fontsize=10)
    return fig


# --- pipeline_figure --------------------------------------------------------------------------


def pipeline_figure(timeline: PipelineTimeline, *, title: str | None = None):
    """A timed pipeline schedule: a row per device stage, a box per forward and backward.

    Stage 0 is on top and time runs to the right; forwards are blue, backwards orange, and
    where the schedule splits the backward (zero-bubble's) its weight gradients (W) yellow,
    each box labelled with its microbatch where it is wide enough. With virtual stages
    (interleaving) a stage's later chunks are drawn lighter. What is left empty is the bubble;
    sends between stages are not drawn, their latency shows as the gaps it causes.

    Args:
      timeline: a `soapjax.strategy.pipeline.PipelineTimeline` (`time_schedule`).
      title: the figure's title (default: the pipeline, its step time and bubble).

    Returns:
      A `matplotlib.figure.Figure`, one `Rectangle` per action (so meant for pipelines of up to
      a few thousand actions).
    """
    if not isinstance(timeline, PipelineTimeline):
        raise PlanError("expected a PipelineTimeline (soapjax.strategy.pipeline.time_schedule), "
                        f"got {type(timeline).__name__}")
    require_matplotlib()
    from matplotlib.patches import Patch, Rectangle

    S, v = timeline.stages, timeline.virtual
    scale, unit = _time_unit(timeline.step_s)
    fig = _figure(11, 1.3 + 0.35 * S)
    ax = fig.subplots()
    points_per_unit = 9.0 * 72 / (timeline.step_s * scale or 1.0)  # about 9 in of axes
    for task in timeline.tasks:
        kind, m, c = task.action
        x, width = task.start_s * scale, (task.end_s - task.start_s) * scale
        gid = f"stage {task.stage}/{kind} {m}/chunk {c}"
        light = 0.5 * (c // S) / (v - 1) if v > 1 else 0.0
        color = _lighter(_ACTION_COLORS[kind], light)
        ax.add_patch(Rectangle((x, task.stage - 0.4), width, 0.8, facecolor=color,
                               edgecolor="white", linewidth=0.5, gid=gid))
        if width * points_per_unit >= 5 * len(str(m)) + 3:
            ax.text(x + width / 2, task.stage, str(m), ha="center", va="center", fontsize=6,
                    color="white" if light < 0.3 else "black", gid=f"{gid}/label")
    ax.set_xlim(0, timeline.step_s * scale or 1.0)
    ax.set_ylim(S - 0.5, -0.5)
    ax.set_yticks(range(S), [f"stage {s}" for s in range(S)], fontsize=7)
    ax.set_xlabel(f"time ({unit})")
    kinds = {task.action[0] for task in timeline.tasks}
    ax.legend(handles=[Patch(facecolor=_ACTION_COLORS[k], label=label)
                       for k, label in _ACTION_LABELS.items() if k in kinds or k != "W"],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    virtual = f" \u00d7 {v} virtual" if v > 1 else ""
    fig.suptitle(title or (
        f"{timeline.schedule}: {S} stages{virtual}, {timeline.microbatches} microbatches; step "
        f"{timeline.step_s * scale:.4g} {unit}, bubble {timeline.bubble_fraction:.1%}"),
        fontsize=10)
    return fig


# A pipeline action's colour: forward, backward (of the input, where the schedule splits the
# backward: zero-bubble's B), and the weights' gradients (its W).
_ACTION_COLORS = {"F": KIND_COLORS["forward"], "B": KIND_COLORS["backward"], "W": "#e6ab02"}
_ACTION_LABELS = {"F": "forward", "B": "backward", "W": "weight gradients (W)"}


def _lighter(color: str, amount: float) -> tuple[float, float, float]:
    """`color` blended towards white by `amount` (0: unchanged, 1: white)."""
    from matplotlib.colors import to_rgb

    return tuple(x + (1.0 - x) * amount for x in to_rgb(color))


# --- comparison_figure ------------------------------------------------------------------------


def comparison_figure(results: Mapping[str, Any], *, highlight: str | None = None,
                      title: str | None = None):
    """Bars of predicted step time and bytes sent per device, one per strategy.

    Args:
      results: strategy name -> a `SimResult` (`soapjax.simulate.front.compare`), or a mapping with
        ``step_time_s`` and optionally ``bytes_moved`` and ``fits_in_memory`` (a plan's
        ``dict(plan.predicted)``).
      highlight: the strategy drawn in the accent colour, the others' times relative to it
        (default: the first).
      title: the figure's title.

    Returns:
      A `matplotlib.figure.Figure`; strategies that do not fit in memory are hatched.
    """
    if not results:
        raise PlanError("comparison_figure needs at least one result")
    names = list(results)
    highlight = highlight if highlight is not None else names[0]
    if highlight not in results:
        raise PlanError(f"highlight {highlight!r} is not among the results {names}")
    times = [_metric(results[n], "step_time_s", n) for n in names]
    sent = [sent_bytes(results[n])[0] if isinstance(results[n], SimResult)  # (a device's)
            else _metric(results[n], "bytes_moved", n, math.nan) for n in names]
    fits = [_metric(results[n], "fits_in_memory", n, True) for n in names]
    t0 = times[names.index(highlight)]
    scale, unit = _time_unit(max(times))
    fig = _figure(11, 1.2 + 0.4 * len(names))
    ax_t, ax_b = fig.subplots(1, 2, sharey=True)
    colors = ["#c44e52" if n == highlight else "#4c72b0" for n in names]
    y = range(len(names))
    bt = ax_t.barh(y, [t * scale for t in times], color=colors)
    known = [b for b in sent if not math.isnan(b)]
    bunit, bscale = byte_unit(max(known, default=0.0))
    bb = ax_b.barh(y, [0 if math.isnan(b) else b / bscale for b in sent], color=colors)
    for name, fit, bar_t, bar_b in zip(names, fits, bt, bb):
        bar_t.set_gid(f"step time/{name}")
        bar_b.set_gid(f"bytes sent/{name}")
        if not fit:
            bar_t.set_hatch("xx")
            bar_b.set_hatch("xx")
    ax_t.bar_label(bt, [f"{t * scale:.3g} {unit} ({t / t0:.2f}\u00d7)"
                        + ("" if f else ", does not fit") for t, f in zip(times, fits)],
                   fontsize=7, padding=2)
    ax_b.bar_label(bb, ["n/a" if math.isnan(b) else f"{b / bscale:.3g} {bunit}" for b in sent],
                   fontsize=7, padding=2)
    ax_t.set_yticks(list(y), names)
    ax_t.invert_yaxis()
    ax_t.set_xlabel(f"predicted step time ({unit})")
    ax_b.set_xlabel(f"bytes sent per device per step ({bunit})")
    for ax in (ax_t, ax_b):
        ax.margins(x=0.35)
    fig.suptitle(title or f"{highlight} against the other strategies (same simulator, same "
                 "costs)", fontsize=10)
    return fig


_MISSING = object()


def _metric(r: Any, key: str, name: str, default: Any = _MISSING) -> Any:
    value = r.get(key, default) if isinstance(r, Mapping) else getattr(r, key, default)
    if value is _MISSING:
        raise PlanError(f"result {name!r} has no {key!r}: expected a SimResult or a mapping "
                        "with step_time_s (and optionally bytes_moved, fits_in_memory)")
    return value


# --- files ------------------------------------------------------------------------------------


def save_pictures(path: str | os.PathLike, graph: OpGraph, strategy: Strategy, mesh: Any,
                  result, comparison: Mapping[str, Any] | None = None, *,
                  dpi: int = 120) -> list[Path]:
    """Writes `plan_figure` to `path`, `timeline_figure` beside it (``NAME-timeline.png``) and,
    given results to compare, `comparison_figure` (``NAME-baselines.png``).

    Returns:
      The paths written (a `path` without a suffix gets ``.png``).

    Raises:
      SettingsError: `path` ends in a format matplotlib cannot write (`check_picture_path`).
    """
    path = Path(path)
    check_picture_path(path)
    if not path.suffix:  # matplotlib would write NAME.png: name the file that is written
        path = path.with_name(path.name + ".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    out = [path, path.with_name(f"{path.stem}-timeline{path.suffix or '.png'}")]
    figures = [plan_figure(graph, strategy, mesh), step_timeline_figure(result)]
    if comparison:
        out.append(path.with_name(f"{path.stem}-baselines{path.suffix or '.png'}"))
        figures.append(comparison_figure(comparison))
    for p, fig in zip(out, figures):
        fig.savefig(p, dpi=dpi)
    return out


# A pipelined step's schedule is drawn box by box up to this many actions (`pipeline_figure`).
MAX_DRAWN_ACTIONS = 5000


def step_timeline_figure(result):
    """The step's timeline `save_pictures` writes: `timeline_figure` of a flat step; of a
    pipelined one, its schedule (`pipeline_figure`: the stages' chunks, the bubble), since
    its `SimResult`'s tasks are the one-stage simulation's over every layer, which drawn
    against the pipeline's step overflowed it; past `MAX_DRAWN_ACTIONS` those tasks, titled
    for what they are."""
    p = result.pipeline
    if p is None:
        return timeline_figure(result)
    if len(p.timeline.tasks) <= MAX_DRAWN_ACTIONS:
        return pipeline_figure(p.timeline)
    return timeline_figure(result, title=(
        f"one stage's devices running every layer, {len(p.timeline.tasks):,} pipeline actions "
        f"too many to draw (the step: {result.step_time_s:.4g} s, bubble "
        f"{p.bubble_fraction:.1%})"))


def check_picture_path(path: str | os.PathLike) -> None:
    """SettingsError unless matplotlib can write a picture named `path` (its suffix: ``.png``,
    ``.svg``, ``.pdf``, ...; none means PNG), so a command can refuse ``--plot out.txt``
    before it works."""
    from matplotlib.backend_bases import FigureCanvasBase

    require_matplotlib()
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise SettingsError(f"cannot write a picture to {os.fspath(path)!r}: matplotlib writes "
                            f"no '.{suffix}' files; expected a name ending in one of "
                            f"{', '.join('.' + f for f in sorted(formats))} (e.g. "
                            f"{Path(path).with_suffix('.png')})")
