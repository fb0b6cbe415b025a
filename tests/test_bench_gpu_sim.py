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
