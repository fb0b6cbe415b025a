"""scripts/gpu_kit.py, the GPU kit: run with --quick on the CPU, its numbers checked for sense.

On a GPU (``-m gpu``) the same quick run checks that the device is the GPU and that its bfloat16
GEMMs reach a plausible share of the datasheet peak.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from soapjax.topology.cluster import MESHES_DIR, Efficiency, load_topology

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "scripts" / "gpu_kit.py"
SECTIONS = ("meta", "device", "overhead", "topology", "kernels", "errors", "skipped",
            "efficiency", "attention_efficiency", "steps", "notes")


def run_kit(out: Path, env: dict[str, str]) -> dict:
    cmd = [sys.executable, str(KIT), "--quick", "--models", "gpt2-tiny", "--budget-s", "120",
           "--profile", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def kit_env() -> dict[str, str]:
    """The environment the kit runs in: CPU, and XLA:CPU's default emitters (the suite's
    loop emitter, tests/conftest.py, makes kernels the kit's profile cannot place)."""
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_cpu_use_fusion_emitters=false",
                                                    "--xla_cpu_use_fusion_emitters=true")
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("kit")
    return run_kit(out, kit_env()), out


def test_every_section_is_there_and_nothing_failed(kit):
    results, out = kit
    assert all(k in results for k in SECTIONS), sorted(results)
    assert results["errors"] == [] and results["skipped"] == []
    assert results["device"]["platform"] == "cpu" and results["device"]["device_count"] >= 1
    assert results["device"]["jax"] == results["meta"]["planner_jax"]
    assert 0 < results["overhead"]["launch_s"] < 0.1
    assert 0 < results["overhead"]["loop_floor_s"] < 0.01


def test_kernels_are_timed_with_positive_rates(kit):
    kernels = kit[0]["kernels"]
    assert {k["kind"] for k in kernels} == {"gemm", "stream", "reduce", "attention", "scatter"}
    for k in kernels:
        assert k["seconds"] > 0 and k["fraction"] > 0, k
        assert k["flops"] > 0 and k["nbytes"] > 0, k
    gemm = next(k for k in kernels if k["kind"] == "gemm")
    m, n, kk = gemm["shape"]
    assert gemm["flops"] == 2 * m * n * kk


def test_the_fitted_table_loads_as_a_topology_files_device_efficiency(kit, tmp_path):
    results, out = kit
    eff = results["efficiency"]
    text = (out / "efficiency.toml").read_text()
    assert text == eff["toml"] and "[device.efficiency]" in text
    table = tomllib.loads(text)["device"]["efficiency"]
    assert set(table["peak_flops"]) == {"bfloat16", "float32"}
    assert table["peak_flops"] == eff["peak_flops"]
    assert all(0 < f <= 1 for f in [*table["peak_flops"].values(), table["memory_bandwidth"]])
    # Pasted into a topology file, the project's parser reads the same table.
    base = (MESHES_DIR / "dgx-h100x8.toml").read_text()
    (tmp_path / "fitted.toml").write_text(base + "\n" + text)
    device = load_topology(tmp_path / "fitted.toml").device
    assert device.efficiency == Efficiency(tuple(eff["peak_flops"].items()),
                                           eff["memory_bandwidth"])


def test_the_flash_attention_efficiency_is_fitted_as_the_kernel_model_counts(kit):
    results, _ = kit
    (t,) = [k for k in results["kernels"] if k["name"].startswith("attention fwd+bwd soapjax")]
    b, seq, n, h = t["shape"]
    tiles = seq // 128 or 1
    flops = 4 * b * n * seq * seq * h * (tiles + 1) / (2 * tiles)  # kernels.causal_tiles
    peak = load_topology("cpu8").device.peak_flops_for(t["dtype"])
    assert results["attention_efficiency"] == pytest.approx(3.5 * flops / (peak * t["seconds"]))


def test_the_step_is_measured_and_predicted(kit):
    (step,) = kit[0]["steps"]
    assert (step["model"], step["config"], step["batch_size"]) == ("gpt2", "tiny", 8)
    assert step["calls"] == 3 and 0 < step["min_s"] <= step["measured_s"] <= step["max_s"]
    assert step["predicted_datasheet_s"] > 0 and step["predicted_fitted_s"] > 0
    assert step["error_datasheet"] == pytest.approx(
        step["predicted_datasheet_s"] / step["measured_s"] - 1)
    assert step["model_flops"] > 0 and step["mfu_bfloat16"] > 0
    assert math.isfinite(step["loss"]) and step["compile_s"] > 0
    # XLA's buffer assignment of the compiled step: the parameters and optimizer state are
    # arguments, donated (aliased) into the outputs
    assert step["xla_argument_bytes"] > 0 and step["xla_output_bytes"] > 0
    assert 0 < step["xla_alias_bytes"] <= step["xla_argument_bytes"]


def test_every_operator_is_timed_beside_the_kernel_model(kit):
    (step,) = kit[0]["steps"]
    ops = step["ops"]
    assert [o["index"] for o in ops] == list(range(step["operators"]))
    assert {o["source"] for o in ops} == {"measured"} and "ops_error" not in step
    for o in ops:
        assert o["forward_s"] > 0 and o["kernel_forward_s"] > 0, o
        assert o["backward_s"] >= 0 and o["kernel_backward_s"] >= 0, o
    # GPT-2's two blocks run the same programs: measured once, priced the same
    by_name = {o["name"]: o for o in ops}
    assert by_name["layers_0/mlp/fc1"]["forward_s"] == by_name["layers_1/mlp/fc1"]["forward_s"]
    assert step["op_stats"]["shared"] > 0
    # the step simulated with those times is at least their sum (plus the optimizer's updates)
    total = sum(o["forward_s"] + o["backward_s"] for o in ops)
    assert step["simulated_measured_ops_s"] >= total
    assert step["error_measured_ops"] == pytest.approx(
        step["simulated_measured_ops_s"] / step["measured_s"] - 1)


def test_the_step_is_profiled_beside_the_kernel_model(kit):
    results, out = kit
    (step,) = results["steps"]
    p = step["profile"]
    assert p["calls"] == 3 and p["unmatched"] == 0 and "profile_error" not in step
    assert 0 < p["busy_s"] <= p["kernels_s"] + 1e-12 and p["kernels"] > 100
    assert p["classes"]["gemm"][1] >= 3 * (2 * 6 + 1)
    assert sum(s for s, _ in p["classes"].values()) == pytest.approx(p["kernels_s"])
    # the CPU's topology has no kernel table: the model's side is its roofline and update
    assert set(p["model"]) == {"roofline", "update"} and p["model"]["roofline"][0] > 0
    # what the profile was read from is kept, so it can be read again without the device
    assert (out / "trace-gpt2-tiny.json.gz").stat().st_size > 0
    assert (out / "hlo-gpt2-tiny.txt.gz").stat().st_size > 0


def test_an_earlier_runs_profiles_are_read_again_without_the_device(kit, tmp_path):
    results, out = kit
    cmd = [sys.executable, str(KIT), "--render-from", str(out), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=kit_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads((tmp_path / "results.json").read_text())
    (before,), (after,) = results["steps"], again["steps"]
    assert after["profile"]["kernels"] == before["profile"]["kernels"]
    for kind, (seconds, n) in before["profile"]["classes"].items():
        assert after["profile"]["classes"][kind] == pytest.approx([seconds, n]), kind
    assert after["profile"]["model"] == before["profile"]["model"]
    assert after["measured_s"] == before["measured_s"]
    text = (tmp_path / "accuracy-section.md").read_text()
    assert "Profiles read again and rendered by" in text and "gpt2 tiny, profiled" in text


def test_a_kernel_filter_keeps_the_named_kernels_only(tmp_path):
    cmd = [sys.executable, str(KIT), "--quick", "--models", "--no-ops", "--kernels",
           "attention,gemm 64x", "--budget-s", "60", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=kit_env(), capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    names = [k["name"] for k in results["kernels"]]
    assert names == ["gemm 64x64x64 bfloat16", "attention fwd+bwd xla 2x32x2x16 float32",
                     "attention fwd+bwd soapjax 2x32x2x16 float32"], names
    assert results["steps"] == [] and results["errors"] == []


def test_the_markdown_section_has_every_table(kit):
    text = (kit[1] / "accuracy-section.md").read_text()
    assert text.startswith("## GPU kit: cpu, ")
    for heading in ("| GEMM (m x n x k) |", "| memory-bound kernel |", "| attention (causal",
                    "[device.efficiency]", "| gpt2 tiny | 8 |", "| `*/mlp/fc1` | 2 |",
                    "gpt2 tiny, profiled", "| class | kernels | device time |",
                    "| model | batch | simulator | XLA: arguments |"):
        assert heading in text, heading


@pytest.mark.gpu  # skipped without a GPU (tests/conftest.py)
def test_on_a_gpu_the_kit_measures_the_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    results = run_kit(tmp_path, env)
    assert results["device"]["platform"] == "gpu" and results["errors"] == []
    assert 0 < results["efficiency"]["peak_flops"]["bfloat16"] <= 1
