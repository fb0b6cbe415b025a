"""scripts/bench_gpu_sim.py, Megatron-LM's Table 1 against the simulator (issue 31): the
published time of the smallest row by hand, its prediction, the fit of the A100's kernel
efficiencies (on one row: two parameters meet one time) and its leave-one-out."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from soapjax_zoo.gpt import GPT_SIZES

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("bench_gpu_sim",
                                                  ROOT / "scripts" / "bench_gpu_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu_sim"] = module  # NamedTuples look their module up
    spec.loader.exec_module(module)
    return module


bench = _load()
SMALLEST = bench.ROWS[0]


def test_every_row_is_a_zoo_size_of_the_tables_shape():
    assert [r.size for r in bench.ROWS] == ["1.7b", "3.6b", "7.5b", "18.4b", "39.1b", "76.1b",
                                           "145.6b", "310.1b", "530b", "1t"]
    for r in bench.ROWS:
        c = GPT_SIZES[r.size]
        assert (c.num_heads, c.d_model, c.num_layers) == (r.heads, r.hidden, r.layers), r.label
        assert (c.seq_len, c.vocab_size) == (2048, 51200)
        assert r.gpus % (r.tp * r.pp) == 0 and r.batch % (r.gpus // (r.tp * r.pp)) == 0


def test_published_time_of_the_smallest_row():
    # 1.7B on 32 GPUs at 137 TFLOP/s: 1 + s/(6h) + V/(16lh) = 1 + 2048/13824 + 51200/884736
    # = 1 + 4/27 + 25/432 = 521/432, so F = 96 x 512 x 2048 x 24 x 2304^2 x 521/432
    # = 1.546683e16 FLOPs, and 1.546683e16 / (32 x 137e12) = 3.528018 s.
    assert SMALLEST.label == "1.7B" and SMALLEST.gpus == 32
    assert bench.paper_flops(SMALLEST) == pytest.approx(1.5466830068e16, rel=1e-10)
    assert bench.published_time(SMALLEST) == pytest.approx(3.528017808, rel=1e-9)
    # the reference note's own example: 1008B, 5.14e19 FLOPs, about 103 s
    assert bench.paper_flops(bench.ROWS[-1]) == pytest.approx(5.14e19, rel=1e-3)
    assert bench.published_time(bench.ROWS[-1]) == pytest.approx(103, rel=0.01)


def test_smallest_row_is_predicted_and_a_fitted_efficiency_slows_it():
    p = bench.predict(SMALLEST)
    assert p.note == "" and p.fits
    assert math.isfinite(p.predicted_s) and p.predicted_s > 0
    assert p.error == pytest.approx((p.predicted_s - p.published_s) / p.published_s)
    # the traced graph counts the matmul FLOPs the paper's formula does, within 1.5 % (the
    # matmul operators' counts also hold their bias adds and the dropout masks' integer hash)
    assert p.flops_ratio == pytest.approx(1.0, abs=0.015)
    # what the fit varies: a GEMM efficiency below the file's makes the step slower
    fitted = bench.row_topology(SMALLEST, None).device.kernels
    half = bench.predict(SMALLEST, {"gemm_efficiency": fitted.gemm_efficiency / 2})
    assert p.predicted_s < half.predicted_s < 2 * p.predicted_s
    with pytest.raises(ValueError, match="not applied by row_topology"):
        bench.row_topology(SMALLEST, {"nccl_bus_bandwidth": 1.0})


def test_leave_one_out_without_a_fit_is_the_plain_prediction():
    assert bench.no_fit(bench.ROWS) is None
    calls = []
    loo = bench.leave_one_out(bench.ROWS[:3], fit=lambda rows: calls.append(len(rows)),
                              predict=lambda row, params: row.size)
    assert loo == ["1.7b", "3.6b", "7.5b"] and calls == [2, 2, 2]


def test_the_fit_meets_a_rows_published_time_and_its_surrogate_is_close():
    params = bench.kernel_fit([SMALLEST])
    assert set(params) == set(bench.FITTED)
    p = bench.predict(SMALLEST, params)
    assert abs(p.error) < 0.02  # the real simulation at the fitted point, not the surrogate
    a, b, c = bench.surrogate(SMALLEST)
    g, m = params["gemm_efficiency"], params["memory_efficiency"]
    assert a + b / g + c / m == pytest.approx(p.predicted_s, rel=0.02)


def test_the_held_out_table_is_korthikanti_et_al_and_its_times_follow_from_the_mfus():
    """Korthikanti et al. 2022's rows: zoo shapes, TP8 with data parallel size one, and the
    published times from the MFUs of Megatron-LM's README: model FLOPs (three passes) over GPUs
    x MFU x 312 TFLOP/s, e.g. 175B: 72 x 64 x 2048 x 96 x 12288^2 x (1 + 2048 / 73728 + 51200 /
    14155776) = 1.4109e17 FLOPs over 64 x 0.514 x 312e12 = 13.75 s, as the paper says."""
    assert set(bench.TABLES) == {"narayanan21", "korthikanti22", "korthikanti22-full"}
    assert bench.TABLES["narayanan21"][1] is bench.ROWS
    rows = {r.size: r for r in bench.KORTHIKANTI}
    assert list(rows) == ["22b", "175b", "530b", "1t"]
    for r in rows.values():
        c = GPT_SIZES[r.size]
        assert (c.num_heads, c.d_model, c.num_layers) == (r.heads, r.hidden, r.layers), r.label
        assert r.gpus == r.tp * r.pp and r.passes == 3 and r.recompute == "selective"
        assert r.sequence_parallel and r.layers % (r.pp * r.interleave) == 0
    assert bench.paper_flops(rows["175b"]) == pytest.approx(1.4109e17, rel=1e-4)
    published = {k: round(bench.published_time(r), 2) for k, r in rows.items()}
    assert published == {"22b": 1.10, "175b": 13.75, "530b": 37.86, "1t": 71.45}
    # the baseline: the same configurations with full recomputation, its times as published
    for full, sel in zip(bench.KORTHIKANTI_FULL, bench.KORTHIKANTI):
        assert full._replace(label=sel.label, recompute="selective", sequence_parallel=True,
                             passes=3, seconds=None, table=sel.table) == sel
        assert 1.28 < bench.published_time(full) / bench.published_time(sel) < 1.33
    # with passes = 4 the general formula is Table 1's, term for term
    r = SMALLEST
    assert bench.paper_flops(r) == pytest.approx(
        96 * r.batch * 2048 * r.layers * r.hidden ** 2
        * (1 + 2048 / (6 * r.hidden) + 51200 / (16 * r.layers * r.hidden)), rel=1e-12)


def test_a_pipelined_rows_terms_add_up_to_its_step():
    """`pipeline_terms` cuts a pipelined step into compute, in-stage communication, bubble,
    imbalance, sends, prologue, layout moves and tail: they add up to the predicted step, the
    bubble at even stages is 1F1B's (S - 1) / M of the chunks' time, and the head's stage makes
    the imbalance positive."""
    row = SMALLEST._replace(pp=4, gpus=32, tp=1, batch=64, microbatch_size=2, label="1.7B PP4")
    p = bench.predict(row)
    assert p.terms is not None and p.note == ""
    assert list(p.terms) == list(bench.TERMS)
    assert sum(p.terms.values()) == pytest.approx(p.predicted_s, rel=1e-9)
    chunks = p.terms["compute"] + p.terms["in-stage communication"]
    m = 64 // 8 // 2  # per-pipeline batch over the microbatch size
    assert p.terms["bubble"] == pytest.approx(chunks * 3 / m, rel=1e-6)
    assert p.terms["stage imbalance"] > 0 and p.terms["layout moves"] == 0
    assert min(p.terms.values()) >= 0
    assert "PP4" in bench.render_terms([p]) and bench.render_terms([bench.predict(SMALLEST)]) == ""


def test_leaving_one_table_out_fits_on_the_others_and_reports_each_table():
    """`leave_tables_out`: each table predicted with the fit on the other tables' rows (here
    a fake fit that records what it was given), then the 2022 tables fitted together with
    Table 1 reported apart."""
    seen = []

    def fit(rows):
        seen.append(tuple(r.label for r in rows))
        return None

    tables = {"narayanan21": ("Table 1", bench.ROWS[:1]),
              "korthikanti22": ("K22", bench.KORTHIKANTI[:1]),
              "korthikanti22-full": ("K22 full", bench.KORTHIKANTI_FULL[:1])}
    text = bench.leave_tables_out(tables, fit)
    assert seen == [("22B", "22B full"), ("1.7B", "22B full"), ("1.7B", "22B"),
                    ("22B full",), ("22B",), ("22B", "22B full")]
    assert "Within the 2022 software, leave one table out: K22 full" in text
    assert "Leave one table out: Table 1" in text and "Leave one table out: K22" in text
    assert "(the 2021 software, apart)" in text
