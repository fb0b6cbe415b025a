"""scripts/bench_h100_tables.py: the published H100 rows are simulated in their recipes'
configurations (Llama 3.1 8B on 8 H100s: TP1, CP2, DP4, cuDNN attention) and compared."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))

import bench_h100_tables as bench  # noqa: E402


def test_the_rows_are_the_recipes_own_configurations():
    by_key = {r.key: r for r in bench.ROWS}
    gpt = by_key["gpt3-175b-128"]
    assert (gpt.tp, gpt.pp, gpt.vp, gpt.mbs, gpt.batch, gpt.seconds) == (4, 8, 6, 1, 256, 8.309)
    for r in bench.ROWS:  # data parallelism times the microbatches a replica runs covers GBS
        dp = r.gpus // (r.tp * r.pp * r.cp)
        assert r.gpus % (r.tp * r.pp * r.cp) == 0 and r.batch % (dp * r.mbs) == 0, r


def test_a_row_is_simulated_and_its_error_reported():
    row = next(r for r in bench.ROWS if r.key == "llama31-8b-8")
    p = bench.predict(row)
    assert p["predicted_s"] > 0 and p["error"] == (p["predicted_s"] - 12.27) / 12.27
    assert "context parallel" in p["note"]
    assert 0 < p["cp1_s"] < p["predicted_s"]  # attention one cuDNN kernel: faster
    text = bench.render([p])
    assert "| llama31-8b-8 | 8 | 128 | 1 | 1 | 2 | 1 | 1 | 12.270 |" in text
    assert "over 1 rows" in text
