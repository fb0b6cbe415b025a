"""soapjax_eval through scripts/evaluate.py: the tiny run writes every section of the results
doc, with numbers."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from soapjax_eval.tables import spearman

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "evaluate.py"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


def test_spearman_matches_the_textbook_example():
    # Wikipedia's IQ vs hours of TV example: rho = -29/165.
    iq = [106, 86, 100, 101, 99, 103, 97, 113, 112, 110]
    tv = [7, 0, 27, 50, 28, 29, 20, 12, 6, 17]
    assert spearman(iq, tv) == pytest.approx(-29 / 165)
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)  # ties: mean ranks
    assert math.isnan(spearman([1.0], [2.0]))


@pytest.mark.slow
def test_tiny_run_writes_every_section_with_numbers(tiny_run):
    out, stderr = tiny_run
    doc = (out / "results.md").read_text()
    assert "search alexnet on p100x16-4" in stderr and "wrote" in stderr  # the progress line
    for key in ("| command | `python scripts/evaluate.py --tiny --out", "| date |",
                "| machine |", "jax 0.", "cost source: analytic", "cost source: measured"):
        assert key in doc
    titles = ["1. Per-iteration performance", "2. Communication", "3. Search cost",
              "4. Search quality", "5. Simulator accuracy"]
    sections = re.split(r"\n## ", doc)[1:]
    assert [s.split(" (paper")[0] for s in sections] == titles
    for s in sections:  # every section has a table whose rows carry numbers
        rows = [line for line in s.splitlines() if line.startswith("| ")][1:]
        assert any(re.search(r"\| -?[0-9][0-9,.]*(x|%)? ", row) for row in rows), s[:200]


@pytest.mark.slow
def test_tiny_run_numbers_hang_together(tiny_run):
    out, _ = tiny_run
    data = json.loads((out / "results" / "results.json").read_text())
    res = data["results"]
    for row in res["throughput"]["rows"]:  # never worse than a fitting baseline
        fitting = [b["step_time_s"] for b in row["baselines"].values() if b["fits"]]
        assert row["soapjax"]["step_time_s"] <= min(fitting)
        if row["devices"] == 1:  # one device: every strategy is the same step
            assert len({round(b["step_time_s"], 15) for b in row["baselines"].values()}) == 1
    comm = res["comm"]["strategies"]
    assert comm["data-parallel"]["bytes_per_device"] > 0
    assert all(r["same_plan"] for r in res["search"]["table4"])
    fig12 = res["search"]["fig12"]
    assert fig12["full"]["history"][-1][1] == fig12["delta"]["history"][-1][1]
    assert all(o["found_optimum"] for o in res["quality"]["optimum"])
    for r in res["quality"]["local"]:  # not a local optimum: a named, faster neighbour
        assert r["local_optimum"] == (r["better_neighbour_s"] is None)
        if not r["local_optimum"]:
            assert r["operator"] and r["better_neighbour_s"] < r["step_time_s"]
    acc = res["accuracy"]
    assert all(r["measured_s"] > 0 and r["simulated_s"] > 0 for r in acc["single"])
    multi = [r for r in acc["multi"] if "error" not in r]
    assert len(multi) >= 2 and all(r["max_abs_diff"] < 1e-4 for r in multi)
    figures = {p.name for p in (out / "results").glob("*.png")}
    pytest.importorskip("matplotlib")
    assert {"fig8b_nmt_bytes.png", "fig11_accuracy.png", "fig12_search_curve.png"} <= figures


@pytest.mark.slow
def test_render_rewrites_the_doc_from_a_run(tiny_run, tmp_path):
    out, _ = tiny_run
    proc = subprocess.run([sys.executable, str(SCRIPT), "--render",
                           str(out / "results" / "results.json"), "--out", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc, again = (out / "results.md").read_text(), (tmp_path / "results.md").read_text()
    assert "| rendered |" in again and "| rendered |" not in doc
    tables = [[line for line in d.splitlines() if line.startswith("| ") and "rendered" not in line]
              for d in (doc, again)]
    assert tables[0] == tables[1]  # the same numbers, nothing rerun
