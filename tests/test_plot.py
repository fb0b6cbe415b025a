"""soapjax.plot and the notebook HTML: the drawn partitions, bars and tables are the plan's.

The figures are checked through their artists (each carries a gid, see `soapjax.plot`): which
device's colour fills which cell of which operator's box, where every bar of the timeline lies,
how long every comparison bar is.
"""

import dataclasses
import json
import sys

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from matplotlib.patches import PathPatch, Rectangle  # noqa: E402

import soapjax_zoo as zoo  # noqa: E402
from soapjax import cli, plot
from soapjax.base.errors import MissingDependencyError, PlanError  # noqa: E402
from soapjax.cost.operators import cost_model  # noqa: E402
from soapjax.cost.reshard import Resharder  # noqa: E402
from soapjax.graph.opgraph import trace  # noqa: E402
from soapjax.simulate import front as simulate
from soapjax.strategy import (
    baselines,
    pipeline,
    space,  # noqa: E402
)
from soapjax.strategy.plan import Plan  # noqa: E402
from soapjax.topology.cluster import load_topology  # noqa: E402

TOPOLOGY = load_topology("cpu8")  # data=2 x model=4
MESH = space.MeshShape.of(TOPOLOGY)


@pytest.fixture(scope="module")
def mlp():
    w = zoo.get("mlp", "tiny")
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="mlp")


@pytest.fixture(scope="module")
def megatron(mlp):
    """fc1 column parallel, fc2 row parallel over model; batch over data (test_check's plan)."""
    by_name = {"fc1": (("data",), ("model",), ()), "fc2": (("data",), (), ("model",)),
               "head": (("data",), (), ()), "mlp": ((), ("data",))}
    return space.Strategy(tuple(space.Config(by_name[op.name]) for op in mlp.operators))


@pytest.fixture(scope="module")
def results(mlp, megatron):
    costs = cost_model(mlp, TOPOLOGY, mode="analytic")
    return simulate.compare(mlp, TOPOLOGY, {"megatron": megatron,
                                            "data-parallel": space.data_parallel(mlp, MESH)},
                            cost_model=costs, resharder=Resharder(MESH, mode="ideal"))


def _area(polygon) -> float:
    xs, ys = polygon[:, 0], polygon[:, 1]
    return abs(float((xs * np.roll(ys, -1) - np.roll(xs, -1) * ys).sum())) / 2


def drawn_cells(fig, label):
    """{(row, col): devices, in stripe order} read off the figure's patches for one box: a
    cell's one device fills it (a Rectangle); several share it in diagonal stripes (one PathPatch
    each, inside the cell, each covering its share of the cell's area)."""
    (ax,) = [ax for ax in fig.axes if ax.get_gid() == label]
    cells: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for patch in ax.patches:
        gid = patch.get_gid() or ""
        if not gid.startswith(f"{label}/device "):
            continue
        device = int(gid.rsplit(" ", 1)[1])
        if isinstance(patch, Rectangle):
            x, y = patch.get_x(), patch.get_y()
            assert (patch.get_width(), patch.get_height()) == (1, 1)
            cells.setdefault((int(y), int(x)), []).append((0.0, device))
            continue
        polygons = patch.get_path().to_polygons()
        points = np.concatenate(polygons)
        (x0, y0), (x1, y1) = points.min(0), points.max(0)
        assert int(x0) == int(x1 - 1e-9) and int(y0) == int(y1 - 1e-9)  # inside one cell
        first = min(polygons, key=lambda p: p.sum(1).min())  # the stripe nearest the corner
        cells.setdefault((int(y0), int(x0)), []).append(
            (first.sum(1).min(), device, sum(_area(p) for p in polygons)))
    for spans in cells.values():
        assert all(s[2] == pytest.approx(1 / len(spans)) for s in spans if len(s) == 3)
    grid = {k: [s[1] for s in sorted(v)] for k, v in cells.items()}
    rows, cols = ax.get_ylim()[0], ax.get_xlim()[1]
    return grid, (int(rows), int(cols))


def outlines(fig, label):
    (ax,) = [ax for ax in fig.axes if ax.get_gid() == label]
    return {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith(f"{label}/cell")}


def test_data_parallel_boxes_are_eight_rows_one_per_device(mlp):
    fig = plot.plan_figure(mlp, space.data_parallel(mlp, MESH), TOPOLOGY)
    colour = {}
    for op in mlp.operators:
        grid, shape = drawn_cells(fig, op.name)
        assert shape == (8, 1)
        assert grid == {(r, 0): [r] for r in range(8)}  # row r: device r (data major, model minor)
        (ax,) = [ax for ax in fig.axes if ax.get_gid() == op.name]
        for patch in ax.patches:
            gid = patch.get_gid() or ""
            if "/device " in gid:
                colour.setdefault(gid.rsplit(" ", 1)[1], set()).add(patch.get_facecolor())
    # one colour per device, the same in every box, and eight different ones
    assert all(len(c) == 1 for c in colour.values())
    assert len({c.pop() for c in colour.values()}) == 8


def test_megatron_boxes(mlp, megatron):
    fig = plot.plan_figure(mlp, megatron, TOPOLOGY)
    by_rows = {(r, c): [4 * r + c] for r in range(2) for c in range(4)}
    grid, shape = drawn_cells(fig, "fc1")  # column parallel: batch over data, features over model
    assert (shape, grid) == ((2, 4), by_rows)
    grid, shape = drawn_cells(fig, "fc2")  # row parallel: the contracting dim over model
    assert (shape, grid) == ((2, 4), by_rows)
    grid, shape = drawn_cells(fig, "head")  # replicated over model: 4 stripes per cell
    assert (shape, grid) == ((2, 1), {(0, 0): [0, 1, 2, 3], (1, 0): [4, 5, 6, 7]})
    # striped diagonally, each device's colour twice: not to be read as 4 columns of a split
    (head,) = [ax for ax in fig.axes if ax.get_gid() == "head"]
    stripes = [p for p in head.patches if "/device " in (p.get_gid() or "")]
    assert len(stripes) == 8 and all(isinstance(p, PathPatch) for p in stripes)
    assert all(len(p.get_path().to_polygons()) == 2 for p in stripes)
    (fc1,) = [ax for ax in fig.axes if ax.get_gid() == "fc1"]
    assert all(isinstance(p, Rectangle) for p in fc1.patches)  # one device per cell: filled
    # partial sums (R split) are hatched, complete outputs are not
    assert all(p.get_hatch() for p in outlines(fig, "fc2").values())
    fc1 = outlines(fig, "fc1")
    assert len(fc1) == 8 and not any(p.get_hatch() for p in fc1.values())
    labels = {ax.get_gid(): ax.get_xlabel() for ax in fig.axes if ax.get_gid()}
    assert labels["fc2"].startswith("[S:data, P:- | R:model]")
    assert "replicated 4\u00d7" in labels["head"]


def test_partitions_follow_the_topologys_device_order(mlp, megatron):
    reordered = dataclasses.replace(TOPOLOGY, device_order=tuple(reversed(range(8))))
    fc1 = plot.partitions(mlp, megatron, reordered)[0]
    assert fc1.cells[0] == plot.Cell(0, 0, (7,)) and fc1.cells[-1] == plot.Cell(1, 3, (0,))


def test_a_plan_draws_alone(mlp, megatron, tmp_path):
    plan = Plan.load(Plan.make(mlp, TOPOLOGY, megatron).save(tmp_path / "p.json"))
    assert plot.partitions(plan) == plot.partitions(mlp, megatron, TOPOLOGY)
    assert plot.partitions(mlp, plan) == plot.partitions(mlp, megatron, MESH)
    grid, shape = drawn_cells(plot.plan_figure(plan), "fc1")
    assert shape == (2, 4) and grid[1, 2] == [6]


def test_repeated_blocks_collapse():
    w = zoo.get("gpt2", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt2")
    parts = plot.partitions(g, baselines.megatron(g, MESH, ("model",)), MESH)
    fc1 = next(p for p in parts if p.label == "layers_{0..1}/mlp/fc1")
    assert fc1.operators == ("layers_0/mlp/fc1", "layers_1/mlp/fc1")
    assert (fc1.rows, fc1.cols, fc1.row_axes, fc1.col_axes) == (2, 4, ("data",), ("model",))
    assert len(plot.partitions(g, space.data_parallel(g, MESH), MESH,
                               collapse_repeats=False)) == len(g.operators)


def test_bad_input(mlp, megatron):
    with pytest.raises(PlanError, match="the strategy has 3 configs but graph 'mlp' has 4"):
        plot.plan_figure(mlp, space.Strategy(megatron.configs[:3]), TOPOLOGY)
    with pytest.raises(PlanError, match="give the mesh the strategy is for"):
        plot.plan_figure(mlp, megatron)
    bad = megatron.replace(0, space.Config((("data",), ("gpu",), ())))
    with pytest.raises(PlanError, match=r"operator 'fc1': dim 1 uses unknown mesh axes \['gpu'\]"):
        plot.partitions(mlp, bad, TOPOLOGY)
    w = zoo.get("lenet", "tiny")
    other = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="lenet")
    with pytest.raises(PlanError, match="made for model 'mlp'"):
        plot.plan_figure(other, Plan.make(mlp, TOPOLOGY, megatron))
    with pytest.raises(PlanError, match="expected an OpGraph"):
        plot.plan_figure(megatron)


def test_old_plan_files_without_roles(mlp, megatron, tmp_path):
    data = Plan.make(mlp, TOPOLOGY, megatron).to_json()
    for op in data["operators"].values():
        del op["roles"], op["spec"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "old.json")
    assert old.roles == ()
    with pytest.raises(PlanError, match="records no dim roles"):
        plot.plan_figure(old)
    assert plot.partitions(mlp, old) == plot.partitions(mlp, megatron, TOPOLOGY)
    assert "<code>[data, model, -]</code>" in old._repr_html_()


def test_timeline_bars_are_the_tasks(results):
    r = results["megatron"]
    fig = plot.timeline_figure(r)
    (ax,) = fig.axes
    # ms from a millisecond on (cpu8's measured call overhead puts this step past one)
    scale, unit = (1e3, "ms") if r.step_time_s >= 1e-3 else (1e6, "\u00b5s")
    assert ax.get_xlabel() == f"time ({unit})"
    tracks = [t.get_text() for t in ax.get_yticklabels()]
    assert tracks == [f"device {d}" for d in range(8)] + list(r.channels)
    drawn = {}
    for coll in ax.collections:
        spans = []
        for path in coll.get_paths():
            xs = path.vertices[:, 0]
            spans.append((round(xs.min(), 6), round(xs.max(), 6)))
        drawn[coll.get_gid()] = sorted(spans)
    expected = {}
    for t in r.tasks:
        where = [f"device {d}" for d in range(8)] if t.resources == ("compute",) else t.resources
        for track in where:
            expected.setdefault(f"{track}/{t.kind}", []).append(
                (round(t.start_s * scale, 6), round(t.end_s * scale, 6)))
    assert drawn == {k: sorted(v) for k, v in expected.items()}
    kinds = {t.kind for t in r.tasks}
    assert {"forward", "backward", "update", "partial_sum"} <= kinds
    # the call overhead (cpu8 measures it) is a labelled span after the last task, and the
    # title counts it apart from the tasks' compute
    end = max(t.end_s for t in r.tasks)
    overhead = r.step_time_s - end
    assert overhead > 0
    labels = {t.get_text() for t in ax.get_legend().get_texts()}
    assert labels == kinds | {"call overhead (per step, not a task)"}
    (span,) = [p for p in ax.patches if p.get_gid() == "call overhead"]
    xs = span.get_path().transformed(span.get_patch_transform()).vertices[:, 0] \
        if isinstance(span, Rectangle) else span.get_xy()[:, 0]
    assert (xs.min(), xs.max()) == pytest.approx((end * scale, r.step_time_s * scale))
    tasks = sum(t.end_s - t.start_s for t in r.tasks if t.resources == ("compute",))
    assert r.compute_s - overhead == pytest.approx(tasks)
    assert (f"compute {tasks * scale:.4g} {unit} + call overhead {overhead * scale:.4g} {unit}"
            in fig._suptitle.get_text())


def test_comparison_bars(results):
    fig = plot.comparison_figure(results)
    bars = {p.get_gid(): p for ax in fig.axes for p in ax.patches if p.get_gid()}
    for name, r in results.items():
        assert bars[f"step time/{name}"].get_width() == pytest.approx(r.step_time_s * 1e3)
        sent = bars[f"bytes sent/{name}"].get_width()
        assert sent == pytest.approx(r.bytes_moved / 1e3)  # kB at this size
    highlighted = bars["step time/megatron"].get_facecolor()
    assert highlighted != bars["step time/data-parallel"].get_facecolor()
    fig = plot.comparison_figure({"a": {"step_time_s": 2e-3, "bytes_moved": 3e6},
                                  "b": {"step_time_s": 1e-3, "fits_in_memory": False}},
                                 highlight="b")
    bars = {p.get_gid(): p for ax in fig.axes for p in ax.patches if p.get_gid()}
    assert bars["step time/a"].get_width() == pytest.approx(2.0)  # ms
    assert bars["bytes sent/a"].get_width() == pytest.approx(3.0)  # MB
    assert bars["step time/b"].get_hatch() and not bars["step time/a"].get_hatch()
    with pytest.raises(PlanError, match="highlight 'c' is not among the results"):
        plot.comparison_figure({"a": {"step_time_s": 1.0}}, highlight="c")
    with pytest.raises(PlanError, match="result 'a' has no 'step_time_s'"):
        plot.comparison_figure({"a": {"bytes_moved": 1.0}})


def test_pipeline_boxes_are_the_timed_actions():
    times = pipeline.ChunkTimes.uniform(2, 1e-3, 2e-3, 0.5e-3)
    t = pipeline.time_schedule("1f1b", 2, 3, 1, times)
    fig = plot.pipeline_figure(t)
    (ax,) = fig.axes
    boxes = {p.get_gid(): p for p in ax.patches if p.get_gid()}
    assert set(boxes) == {f"stage {s}/{k} {m}/chunk {s}" for s in range(2) for k in "FB"
                          for m in range(3)}
    for task in t.tasks:
        kind, m, c = task.action
        box = boxes[f"stage {task.stage}/{kind} {m}/chunk {c}"]
        assert (box.get_x(), box.get_width(), box.get_y(), box.get_height()) == pytest.approx(
            (task.start_s * 1e3, (task.end_s - task.start_s) * 1e3, task.stage - 0.4, 0.8))
    assert ax.get_xlabel() == "time (ms)" and ax.get_xlim() == pytest.approx((0, t.step_s * 1e3))
    assert ax.get_ylim() == (1.5, -0.5)  # stage 0 on top
    assert [label.get_text() for label in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    colours = {k: {p.get_facecolor() for g, p in boxes.items() if f"/{k} " in g} for k in "FB"}
    assert len(colours["F"]) == len(colours["B"]) == 1 and colours["F"] != colours["B"]
    # the bubble is what is left: each stage's boxes cover its busy time
    for s in range(2):
        covered = sum(p.get_width() for g, p in boxes.items() if g.startswith(f"stage {s}/"))
        assert covered == pytest.approx(t.busy_s[s] * 1e3)
    # every box here is wide enough for its microbatch number, written in its middle
    labels = {x.get_gid(): x for x in ax.texts}
    assert set(labels) == {f"{g}/label" for g in boxes}
    for g, box in boxes.items():
        assert labels[f"{g}/label"].get_text() == g.split("/")[1].split()[1]
        assert labels[f"{g}/label"].get_position() == pytest.approx(
            (box.get_x() + box.get_width() / 2, box.get_y() + 0.4))
    # F0 F1 | B0 at 5 ms (gradient back at 4.5 + 0.5) ... stage 0's B2 ends at 14 ms; 9 of 14 busy
    assert fig._suptitle.get_text() == "1f1b: 2 stages, 3 microbatches; step 14 ms, bubble 35.7%"
    with pytest.raises(PlanError, match="expected a PipelineTimeline"):
        plot.pipeline_figure(r"not a timeline")


def test_pipeline_figure_shades_virtual_chunks_and_skips_narrow_labels():
    times = pipeline.ChunkTimes((1.0,) * 4, (1e-4,) * 4, (0.0,) * 3)
    t = pipeline.time_schedule("interleaved", 2, 2, 2, times)
    (ax,) = plot.pipeline_figure(t).axes
    boxes = {p.get_gid(): p for p in ax.patches if p.get_gid()}
    assert len(boxes) == len(t.tasks) == 16
    assert ax.get_xlabel() == "time (s)"
    later = boxes["stage 0/F 0/chunk 2"].get_facecolor()
    first = boxes["stage 0/F 0/chunk 0"].get_facecolor()
    assert all(x >= y for x, y in zip(later[:3], first[:3])) and later != first  # lighter
    # forwards of 1 s are labelled, backwards of 0.1 ms are too narrow
    assert {x.get_gid() for x in ax.texts} == {f"{g}/label" for g in boxes if "/F " in g}


def test_without_matplotlib(monkeypatch, mlp, megatron, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'soapjax\[plot\]'"):
        plot.plan_figure(mlp, megatron, TOPOLOGY)
    assert issubclass(MissingDependencyError, ImportError)
    # the command line says so before tracing or searching anything
    argv = ["plan", "--model", "mlp", "--config", "tiny", "--mesh", "cpu8", "--plot",
            str(tmp_path / "p.png"), "--out", str(tmp_path / "p.json")]
    assert cli.main(argv) == 2
    assert "pip install 'soapjax[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_plan_command_writes_pictures(tmp_path, capsys):
    argv = ["plan", "--model", "mlp", "--config", "tiny", "--mesh", "cpu8", "--costs",
            "analytic", "--proposals", "20", "--out", str(tmp_path / "p.json"), "--plot",
            str(tmp_path / "pics" / "mlp.png")]
    assert cli.main(argv) == 0
    names = sorted(p.name for p in (tmp_path / "pics").iterdir())
    assert names == ["mlp-baselines.png", "mlp-timeline.png", "mlp.png"]
    for name in names:
        assert (tmp_path / "pics" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "pictures: " in capsys.readouterr().out


# --- HTML ---------------------------------------------------------------------------------------


def test_plan_html_lists_partition_specs(mlp, megatron, results):
    plan = Plan.make(mlp, TOPOLOGY, megatron, model_config="tiny",
                     predicted=results["megatron"].to_json(),
                     baselines={"data-parallel": results["data-parallel"].step_time_s})
    html = plan._repr_html_()
    assert "<code>P('data', 'model')</code>" in html  # fc1's output
    assert "[S:data, P:- | R:model]" in html  # fc2's config
    assert "<code>P('model', None)</code>" in html  # fc2's kernel, stored row parallel
    assert "data-parallel" in html and "mlp (tiny) on cpu8" in html
    assert plan.output_specs()["fc1"] == space.Config((("data",), ("model",), ())).output_spec(
        mlp.operator("fc1"))


def test_html_groups_by_module_and_escapes():
    w = zoo.get("gpt2", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt2")
    plan = Plan.make(g, load_topology("cpu8"), baselines.megatron(g, MESH, ("model",)))
    html = plan._repr_html_()
    assert html.count("<th ") == 4 + 1  # the column heads, one module head
    rows = html.split("<tr>")
    heads = [r for r in rows if r.startswith('<th colspan')]
    assert [h.split(">")[1].split("<")[0] for h in heads] == ["layers_{0..1}/"]
    assert "<td style=\"text-align:left;padding-left:1.5em\">mlp/fc1</td><td>2</td>" in html
    graph_html = dataclasses.replace(g, name="<gpt2 & co>")._repr_html_()
    assert "&lt;gpt2 &amp; co&gt;" in graph_html and "<gpt2" not in graph_html
    assert "attn/query" in graph_html


def test_sim_result_html(results):
    html = results["megatron"]._repr_html_()
    r = results["megatron"]
    assert f"{r.step_time_s * 1e3:.4g} ms" in html and "8, " in html


def test_a_pipelined_steps_timeline_picture_is_its_schedule(monkeypatch):
    """`soapjax plan --plot` of a pipelined plan drew the one-stage simulation's tasks (every
    layer) against the pipeline's step, past its end; it draws the schedule now, a box per
    action, and past `MAX_DRAWN_ACTIONS` those tasks, titled for what they are."""
    w = zoo.get("gpt", "tiny", batch_size=16)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")
    topo = load_topology("dgx-a100x3072-32")
    flat = baselines.baselines(g, topo, w.family)["megatron"]
    piped = flat.with_microbatches(4).with_pipeline(2, 1, "1f1b")
    r = simulate.simulate(g, topo, piped, cost_model=cost_model(g, topo, mode="analytic"))
    (ax,) = plot.step_timeline_figure(r).axes
    boxes = [p for p in ax.patches if (p.get_gid() or "").startswith("stage ")]
    assert len(boxes) == len(r.pipeline.timeline.tasks) == 2 * 2 * 4
    monkeypatch.setattr(plot, "MAX_DRAWN_ACTIONS", 4)
    fig = plot.step_timeline_figure(r)
    assert fig._suptitle.get_text().startswith("one stage's devices running every layer, 16 "
                                               "pipeline actions too many to draw")
    one = simulate.simulate(g, topo, flat, cost_model=cost_model(g, topo, mode="analytic"))
    assert plot.step_timeline_figure(one)._suptitle.get_text().startswith("simulated step")
    # beside the baselines (--plot's third picture), a device's bytes: not every stage's
    fig = plot.comparison_figure({"plan": r, "megatron": one})
    bars = {p.get_gid(): p for ax in fig.axes for p in ax.patches if p.get_gid()}
    assert bars["bytes sent/plan"].get_width() * 1e3 == pytest.approx(r.bytes_moved / 2)
    assert bars["bytes sent/megatron"].get_width() * 1e3 == pytest.approx(one.bytes_moved)


def test_a_split_backwards_weight_gradients_have_their_own_colour():
    """Zero-bubble schedules split the backward into B and W: W was drawn in B's colour under
    the legend's "backward"; it has its own colour and legend entry now, and a schedule
    without W shows two entries."""
    times = pipeline.ChunkTimes((1.0,) * 2, (1.0,) * 2, (0.0,), weight_s=(0.5,) * 2)
    t = pipeline.time_schedule("zb-h1", 2, 2, 1, times)
    (ax,) = plot.pipeline_figure(t).axes
    colours = {k: {p.get_facecolor() for p in ax.patches if f"/{k} " in (p.get_gid() or "")}
               for k in "FBW"}
    assert all(len(c) == 1 for c in colours.values())
    assert len({next(iter(c)) for c in colours.values()}) == 3
    assert [x.get_text() for x in ax.get_legend().get_texts()] == [
        "forward", "backward", "weight gradients (W)"]
    (ax,) = plot.pipeline_figure(pipeline.time_schedule(
        "1f1b", 2, 2, 1, pipeline.ChunkTimes.uniform(2, 1.0, 1.0))).axes
    assert [x.get_text() for x in ax.get_legend().get_texts()] == ["forward", "backward"]
