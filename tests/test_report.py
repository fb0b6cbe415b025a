"""What soapjax shows: sizes, repeated blocks collapsed, the plan text, notebook HTML."""

import dataclasses

import pytest

import soapjax_zoo
from soapjax import report
from soapjax.cost.operators import cost_model
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.report import byte_unit, format_bytes, group_repeats, grouped_configs, plan_report
from soapjax.simulate.front import SimResult, simulate
from soapjax.strategy.baselines import baselines
from soapjax.strategy.plan import Plan
from soapjax.topology.cluster import load_topology


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (999, "999 B"), (1000, "1 kB"), (1234567, "1.235 MB"), (2 * 2**30, "2.147 GB"),
    (3.5e12, "3500 GB"),
])
def test_one_byte_formatter(n, text):
    assert format_bytes(n) == text


def test_byte_unit_is_what_plots_scale_by():
    assert byte_unit(999) == ("B", 1.0) and byte_unit(3.2e8) == ("MB", 1e6)


def test_repeated_blocks_collapse_into_one_row():
    items = [(f"layers_{i}/mlp/fc1", "same") for i in range(12)] + [("ln_f", "x"),
                                                                  ("layers_3/attn", "a")]
    assert group_repeats(items) == [
        ("layers_{0..11}/mlp/fc1", list(range(12))), ("ln_f", [12]), ("layers_3/attn", [13]),
    ]
    # a different key keeps its own row
    items[5] = ("layers_5/mlp/fc1", "other")
    rows = group_repeats(items)
    assert ("layers_5/mlp/fc1", [5]) in rows and rows[0][1] == [0, 1, 2, 3, 4, *range(6, 12)]


def test_the_plan_text_lists_configs_baselines_bytes_and_memory():
    w = soapjax_zoo.get("gpt2", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt2")
    topo = load_topology("cpu8")
    base = baselines(g, topo, w.family)
    costs = cost_model(g, topo, mode="analytic")  # the text is the subject, not the timings
    sim = simulate(g, topo, base["megatron"], cost_model=costs)
    dp = simulate(g, topo, base["data-parallel"], cost_model=costs)
    text = plan_report(g, topo, base["megatron"], sim, header=["gpt2 on cpu8"],
                       baselines=[("data-parallel", dp.step_time_s, dp.fits_in_memory)])
    rows = grouped_configs(g, base["megatron"])
    assert sum(count for _, count, _ in rows) == len(g.operators)
    assert any(name.startswith("layers_{0..") and count > 1 for name, count, _ in rows)
    lines = text.splitlines()
    assert lines[0] == "gpt2 on cpu8"
    ratio = dp.step_time_s / sim.step_time_s
    assert f"  {'data-parallel':<16} {dp.step_time_s * 1e3:10.3f} ms  {ratio:5.2f}x" in text
    assert f"bytes moved per device per step: {format_bytes(sim.bytes_moved)}" in text
    assert f"memory per device: {format_bytes(sim.memory.total)} of " in text


def test_a_pipelined_steps_parts_are_a_devices_and_add_up_to_the_step():
    """A pipelined step's compute and bytes are a device's share: its `SimResult` holds the
    one-stage simulation's, over all the layers (the reports printed it beside the step:
    Llama 2 70B on 64 H100s in 8 stages, "771 ms = compute 4439 ms + exposed communication
    0 ms", 521.8 GB sent per device); the parts add up to the step, and a flat step's are
    its own."""
    w = soapjax_zoo.get("gpt", "tiny", batch_size=16)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")
    topo = load_topology("dgx-a100x3072-32")
    costs = cost_model(g, topo, mode="analytic")
    flat = baselines(g, topo, w.family)["megatron"]
    stages = 2
    piped = flat.with_microbatches(4).with_pipeline(stages, 1, "1f1b")
    sim = simulate(g, topo, piped, cost_model=costs)
    assert sim.pipeline is not None and sim.compute_s > sim.step_time_s  # every stage's
    (name, compute), (_, rest) = report.step_terms(sim)
    assert name == "compute" and compute == pytest.approx(sim.compute_s / stages)
    assert 0 < compute < sim.step_time_s and compute + rest == pytest.approx(sim.step_time_s)
    sent, classes = report.sent_bytes(sim)
    assert sent == pytest.approx(sim.bytes_moved / stages)
    assert sum(classes.values()) == pytest.approx(sent)
    text = plan_report(g, topo, piped, sim, baselines=[])
    assert f"bytes moved per device per step: {format_bytes(sent)}" in text
    assert (f"compute {compute * 1e3:.3f} ms, communication, bubble, sends, prologue and tail "
            f"{rest * 1e3:.3f} ms") in text
    assert "the fullest stage's (each stage's: the pipeline line)" in text
    assert "(SPMD)" not in text  # stages hold different layers
    one = simulate(g, topo, flat, cost_model=costs)
    assert report.step_terms(one) == (("compute", one.compute_s),
                                      ("exposed communication", one.exposed_comm_s))
    assert report.sent_bytes(one)[0] == one.bytes_moved


def test_the_plan_text_says_what_is_recomputed_and_the_microbatches():
    """A plan that keeps some layer operators' outputs and recomputes the rest (as
    `soapjax.search.recompute` leaves one) says which, row by row, and its microbatches."""
    w = soapjax_zoo.get("llama", "tiny-flash", batch_size=8)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="llama")
    topo = load_topology("cpu8")
    base = baselines(g, topo, w.family)["megatron"]
    policies = tuple("full" if op.block_position and not op.name.endswith("/attn") else "none"
                     for op in g.operators)
    strategy = dataclasses.replace(base, recompute=policies, microbatches=2)
    costs = cost_model(g, topo, mode="analytic")
    text = plan_report(g, topo, strategy, simulate(g, topo, strategy, cost_model=costs),
                       baselines=[])
    rows = {line.split()[0]: line for line in text.splitlines()
            if line.startswith("  layers_{0..1}/")}
    assert rows["layers_{0..1}/mlp/up"].endswith("recomputed (full)")
    assert "recomputed" not in rows["layers_{0..1}/attn"]
    assert "  gradients accumulated over 2 microbatches of 4 samples" in text.splitlines()
    plain = plan_report(g, topo, base, simulate(g, topo, base, cost_model=costs), baselines=[])
    assert "recomputed" not in plain and "microbatches" not in plain


def test_import_soapjax_gives_plans_graphs_and_sim_results_their_notebook_html():
    """`import soapjax` calls report.register_html_reprs (graph -> report -> plan -> graph was a
    cycle); calling it again changes nothing."""
    for _ in range(2):
        assert Plan._repr_html_ is report.plan_html
        assert OpGraph._repr_html_ is report.graph_html
        assert SimResult._repr_html_ is report.sim_html
        report.register_html_reprs()

